"""Batching policies, by name (`--policy NAME`)."""
from __future__ import annotations

from batchserve.core.policies.base import Policy
from batchserve.core.policies.continuous import ContinuousPolicy

POLICIES: dict[str, type[Policy]] = {
    ContinuousPolicy.name: ContinuousPolicy,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy: unknown {name!r}; choose from {sorted(POLICIES)}") from None


__all__ = ["POLICIES", "Policy", "make_policy"]
