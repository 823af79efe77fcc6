"""The simulator: the real engine (queue, scheduler, policy, KV manager) on a virtual clock,
with a cost model in place of the model runner.

    from batchserve.sim import RooflineCost, Simulator
    res = Simulator(EngineConfig(), RooflineCost("a100-80gb", "llama-2-7b")).run(make_workload("chat", 1000, 10.0))
    res.summary  # the same summary `bench` computes, over virtual time

events.py (typed events, deterministic order), executor.py (SimExecutor), cost.py (roofline and
profiled cost models), hardware.py (GPU specs, model shapes), simulator.py (the loop),
runner.py (`batchserve simulate`), cluster.py (several engines on one clock: `serve --ray`'s
replicas and prefill/decode layouts), cascade.py (the `cascade` policy on two devices: a
prefill stage and a decode stage, each on its own clock, the K/V handed across). The seed's
case studies are in `batchserve.scenarios`; the checks against the live engine, of the
simulator's own speed, the multi-GPU projection and where cascading pays are benchmark
scripts (`benchmarks.fidelity`, `benchmarks.speed`, `benchmarks.cluster_projection`,
`benchmarks.cascade`), outside the package.
"""
from batchserve.sim.cascade import CascadeResult, CascadeSimulator
from batchserve.sim.cost import CostModel, ProfiledCost, RooflineCost, make_cost_model
from batchserve.sim.executor import SimExecutor
from batchserve.sim.simulator import SimResult, SimulationStuck, Simulator

__all__ = ["CascadeResult", "CascadeSimulator", "CostModel", "ProfiledCost", "RooflineCost", "SimExecutor",
           "SimResult", "SimulationStuck", "Simulator", "make_cost_model"]
