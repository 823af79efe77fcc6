"""Batching policies, by name (`--policy NAME`)."""
from __future__ import annotations

from batchserve.config import SchedulerConfig
from batchserve.core.policies.base import Policy
from batchserve.core.policies.cascade import CascadePolicy
from batchserve.core.policies.chunked import ChunkedPolicy
from batchserve.core.policies.continuous import ContinuousPolicy
from batchserve.core.policies.dynamic import DynamicPolicy
from batchserve.core.policies.static import StaticPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (StaticPolicy, DynamicPolicy, ContinuousPolicy, ChunkedPolicy, CascadePolicy)
}


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    """A fresh policy of the named kind, reading its settings from `config`."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(config)


__all__ = ["POLICIES", "Policy", "make_policy"]
