"""The Ray router's own metrics, appended to /metrics by `serve --ray`: which replicas answer,
how many requests each was sent, replica deaths and retries, prefill -> decode K/V hand-offs.

Every sample carries `model_name`, as the single server's `batchserve:*` metrics do
(server/metrics.py), so one query selects a model's series whether it is served by one process
or by replicas. The text is written by prometheus-client's exposition, so names, escaping and
the HELP / TYPE lines follow the same rules as the rest of the page.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass(frozen=True)
class ReplicaView:
    """What /metrics shows of one replica."""

    key: int
    role: str  # both | prefill | decode
    up: bool
    routed: int


@dataclass(frozen=True)
class RouterCounters:
    """The router's totals since start (seconds are wall time)."""

    replica_failures: int = 0
    retries: int = 0
    handoffs: int = 0
    handoff_tokens: int = 0
    handoff_seconds: float = 0.0
    handoff_copy_seconds: float = 0.0


# (name without _total, HELP, RouterCounters field)
_COUNTERS = (
    ("replica_failures", "Replica deaths the router saw", "replica_failures"),
    ("router_retries", "Requests placed again after their replica died", "retries"),
    ("kv_handoffs", "Requests handed from a prefill to a decode worker", "handoffs"),
    ("kv_handoff_tokens", "Prompt tokens whose K/V was handed over", "handoff_tokens"),
    ("kv_handoff_seconds", "First token out of a prefill worker to adopted by a decode worker (K/V export, "
     "object store, Ray calls, the decode worker's step boundary, import)", "handoff_seconds"),
    ("kv_handoff_copy_seconds", "K/V copy time of the hand-offs (export + import)", "handoff_copy_seconds"),
)


class _RouterCollector:
    def __init__(self, model_name: str, replicas: Iterable[ReplicaView], counters: RouterCounters) -> None:
        self.model_name, self.replicas, self.counters = model_name, list(replicas), counters

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "replica", "role"]
        up = GaugeMetricFamily("batchserve:replica_up", "Whether a replica answers (1) or is down (0)", labels=labels)
        routed = CounterMetricFamily("batchserve:replica_routed", "Requests the router sent to a replica",
                                     labels=labels)
        for r in self.replicas:
            key = [self.model_name, str(r.key), r.role]
            up.add_metric(key, int(r.up))
            routed.add_metric(key, r.routed)
        yield up
        yield routed
        for name, help_, attr in _COUNTERS:
            fam = CounterMetricFamily(f"batchserve:{name}", help_, labels=["model_name"])
            fam.add_metric([self.model_name], getattr(self.counters, attr))
            yield fam


def router_metrics_text(model_name: str, replicas: Iterable[ReplicaView], counters: RouterCounters) -> str:
    """The router's families in the Prometheus text format, each sample labelled `model_name`."""
    return generate_latest(_RouterCollector(model_name, replicas, counters)).decode()
