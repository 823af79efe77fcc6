"""The seed's four case studies, replayed by the simulator (`batchserve simulate --scenario NAME`).

Each scenario runs the real engine (queue, scheduler, the policies it compares, KV manager) on
the roofline model of the hardware the seed names — an A100 80GB with a 7B Llama in FP16 —
and prints the seed's before/after figures next to the simulated ones, with a verdict per
row (does the change go the seed's way?) and notes on why the numbers differ. Nothing is
tuned to match: loads are set from the engine's own measured capacity, by a rule stated in
each scenario's setup line.

A `Backend` runs the same scenarios elsewhere: on another cost model, or (given a `run`
that drives a real engine on the wall clock and returns a SimResult) live, with fewer and
shorter requests (`size`, `scale`) so that a slow machine finishes in minutes. The loads
follow that backend's own measured capacity, by the same rules.

These live outside `sim/` because they name policies; the simulator itself knows none.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

from batchserve.bench.workload import WorkItem
from batchserve.config import EngineConfig
from batchserve.core.policies import POLICIES
from batchserve.sim.cost import CostModel
from batchserve.sim.simulator import SimResult

RunFn = Callable[[EngineConfig, Sequence[WorkItem], "float | None"], SimResult]  # (config, items, slo_ms)


class ScenarioUnavailable(ValueError):
    """A scenario needs a policy that is not registered (yet)."""


@dataclass(frozen=True)
class Backend:
    """Where a scenario's runs happen. `run(config, items, slo_ms)` returns each run's
    SimResult; None: the simulator on `cost`, or on the scenario's own cost model (the A100
    roofline) when `cost` is None too. `size` multiplies every request count and `scale`
    every mix's lengths (prompts and outputs). `label` heads the result columns."""

    label: str = "sim"
    cost: CostModel | None = None
    run: RunFn | None = None
    size: float = 1.0
    scale: float = 1.0

    def runner(self, default_cost: Callable[[], CostModel]) -> RunFn:
        if self.run is not None:
            return self.run
        from batchserve.sim.runner import simulate

        cost = self.cost or default_cost()
        return lambda config, items, slo_ms=None: simulate(config, cost, items, slo_ms)

    def requests(self, n: int, least: int = 1) -> int:
        return max(least, round(n * self.size))

    @property
    def seed_hardware(self) -> bool:
        """Runs on the scenario's own roofline: its notes (about that hardware) apply."""
        return self.run is None and self.cost is None

    def lengths(self, scale: float = 1.0) -> str:
        """A setup line's remark on scaled lengths ("" when unscaled)."""
        return "" if self.scale == 1.0 else f" (lengths here x{self.scale:g}: {scale * self.scale:g} of the mix's)"


SIM = Backend()


@dataclass
class Row:
    """One compared figure. `better` says which way is an improvement: "lower" | "higher"."""

    metric: str
    seed_before: float | None
    seed_after: float | None
    sim_before: float | None
    sim_after: float | None
    better: str = "lower"
    unit: str = ""

    def verdict(self) -> str:
        if None in (self.sim_before, self.sim_after):
            return "-"
        if self.sim_after == self.sim_before:
            return "unchanged"
        sim_up = self.sim_after > self.sim_before  # type: ignore[operator]
        if self.seed_before is None or self.seed_after is None:
            return "improves" if sim_up == (self.better == "higher") else "worsens"
        seed_up = self.seed_after > self.seed_before
        return "agrees" if sim_up == seed_up else "DISAGREES"


@dataclass
class ScenarioResult:
    name: str
    title: str
    setup: list[str]
    before: str  # label of the baseline configuration
    after: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    runs: dict[str, tuple[float, SimResult]] = field(default_factory=dict)  # label -> (rate, run)
    label: str = "sim"  # the backend's

    def markdown(self) -> str:
        b, a, x = self.before, self.after, self.label
        out = [f"## {self.name}: {self.title}", ""] + [f"- {s}" for s in self.setup] + [
            "", f"| metric | seed: {b} | seed: {a} | {x}: {b} | {x}: {a} | direction |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            cells = [fmt_cell(v, r.unit) for v in (r.seed_before, r.seed_after, r.sim_before, r.sim_after)]
            out.append(f"| {r.metric} | " + " | ".join(cells) + f" | {r.verdict()} |")
        if self.notes:
            out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out)


def fmt_cell(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{100 * v:.1f}%"
    if unit == "x":
        return f"{v:.2f}x"
    if isinstance(v, int) or abs(v) >= 10:
        return f"{v:,.0f}{unit}"
    return f"{v:.2f}{unit}"


def require(*policies: str) -> None:
    """Fail clearly when a compared policy has not landed."""
    missing = [p for p in policies if p not in POLICIES]
    if missing:
        many = len(missing) > 1
        raise ScenarioUnavailable(f"this scenario needs the {', '.join(missing)} polic{'ies' if many else 'y'}, "
                                  f"which {'are' if many else 'is'} not registered "
                                  f"(registered: {', '.join(sorted(POLICIES))})")


def _registry() -> dict[str, Callable[[int | None, int, Backend], ScenarioResult]]:
    from batchserve.scenarios import batching, load

    return {"priority-flood": load.priority_flood, "adaptive-window": load.adaptive_window,
            "mixed-granularity": batching.mixed_granularity, "static-vs-continuous": batching.static_vs_continuous}


SCENARIOS = ("priority-flood", "adaptive-window", "mixed-granularity", "static-vs-continuous")
CHOICES = SCENARIOS + ("all",)


def scenario_result(name: str, requests: int | None = None, seed: int = 0, backend: Backend = SIM) -> ScenarioResult:
    """One scenario's runs on `backend`, and its figures."""
    return _registry()[name](requests, seed, backend)


def run_scenario(name: str, requests: int | None = None, seed: int = 0, out_dir: str | None = None) -> str:
    """Run one scenario (or "all") in the simulator; return its markdown. With `out_dir`, every
    run's bench report (records, summary, plots) goes to out_dir/<scenario>/<run>/."""
    from batchserve.sim.runner import write_outputs

    names = SCENARIOS if name == "all" else (name,)
    texts = []
    for n in names:
        res = scenario_result(n, requests, seed)
        if out_dir:
            for label, (rate, run) in res.runs.items():
                write_outputs(os.path.join(out_dir, n, label), [(rate, run)], {"label": f"{n} {label}"})
            with open(os.path.join(out_dir, n, "scenario.md"), "w") as f:
                f.write(res.markdown() + "\n")
        texts.append(res.markdown())
    return "\n\n".join(texts)
