"""Batching policies, by name (`--policy NAME`)."""
from __future__ import annotations

from batchserve.config import SchedulerConfig
from batchserve.core.latency import LatencyModel
from batchserve.core.policies.base import Policy
from batchserve.core.policies.cascade import CascadePolicy
from batchserve.core.policies.chunked import ChunkedPolicy
from batchserve.core.policies.continuous import ContinuousPolicy
from batchserve.core.policies.dynamic import DynamicPolicy
from batchserve.core.policies.static import StaticPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (StaticPolicy, DynamicPolicy, ContinuousPolicy, ChunkedPolicy, CascadePolicy)
}


def make_policy(name: str, config: SchedulerConfig | None = None, latency: LatencyModel | None = None) -> Policy:
    """A fresh policy of the named kind, reading its settings from `config`. `latency`: the
    engine's step-time model (a loaded profile), for the policies that plan with it (`dynamic`);
    the others ignore it."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"policy: unknown {name!r}; choose from {sorted(POLICIES)}") from None
    if issubclass(cls, DynamicPolicy):
        return cls(config, latency=latency)
    return cls(config)


__all__ = ["POLICIES", "Policy", "make_policy"]
