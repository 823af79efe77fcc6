"""Fair tenants, model-free (fake executor, virtual clock): within a level, the tenant served
least lately goes first, for the queue and for seats, so a tenant sending four times the
tokens (and more) cannot push another's P99 time to first token beyond 1.2x its value when
alone; without tenants the same traffic is served in arrival order and the light one waits
behind the heavy one's backlog."""
import random

import pytest

from batchserve.config import CacheConfig, EngineConfig, LevelConfig, QueueConfig, SchedulerConfig
from batchserve.core.stats import percentile
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import SamplingParams
from tests.conftest import FakeExecutor


def ttft_p99(rate_heavy: float, tenants: bool = True, seed: int = 1, duration: float = 10.0,
             heavy_from: float = 0.0):
    """P99 TTFT (ms) of a light tenant (10 req/s) and the heavy one beside it, the heavy one
    sending from `heavy_from` on (the light one's P99 counted from then); 8 seats, 16-token
    prompts, 16-token answers, 10 ms steps (capacity 50 req/s)."""
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=4096), scheduler=SchedulerConfig(max_num_seqs=8))
    eng = LLMEngine(cfg, FakeExecutor(4096, step_time=0.01), clock=SimClock())
    rng = random.Random(seed)
    arrivals = []
    for name, rate in (("light", 10.0), ("heavy", rate_heavy)):
        t = (heavy_from if name == "heavy" else 0.0) + rng.expovariate(rate) if rate else duration
        while t < duration:
            arrivals.append((t, name))
            t += rng.expovariate(rate)
    arrivals.sort()
    who, outs, i, t = {}, {}, 0, 0.0
    while i < len(arrivals) or eng.has_unfinished:
        while i < len(arrivals) and arrivals[i][0] <= t:
            at, name = arrivals[i]
            i += 1
            r = eng.add_request([1] * 16, SamplingParams(max_tokens=16, ignore_eos=True), now=at,
                                tenant=name if tenants else None)
            who[r.request_id] = name
        for o in eng.step(now=t).outputs:
            if o.finished:
                assert o.finish_reason == "length"
                outs[o.request_id] = o
        t += 0.01
    assert len(outs) == len(arrivals)
    eng.kv.check_all_free()
    p99 = {name: 1000 * percentile([o.first_token_time - o.arrival_time for rid, o in outs.items()
                                     if who[rid] == name and o.arrival_time >= heavy_from], 99)
           for name in ("light", "heavy") if name in who.values()}
    return p99, eng.scheduler.waiting.stats(t)


@pytest.mark.parametrize("heavy", [40.0, 60.0])  # 4x the light tenant's tokens, and 6x (past capacity)
def test_a_heavy_tenant_cannot_slow_a_light_one(heavy):
    alone, _ = ttft_p99(0.0)
    shared, st = ttft_p99(heavy)
    assert shared["light"] <= 1.2 * alone["light"]
    assert st.preemptions["fairness"] > 0  # seats, too, went to the light tenant
    n, tokens = st.tenants["light"]
    assert set(st.tenants) == {"light", "heavy"} and tokens == 31 * n  # 16 + 15 each: nothing recomputed
    fifo, _ = ttft_p99(heavy, tenants=False)
    assert fifo["light"] > 3 * alone["light"]  # what happens without tenants


def test_a_tenant_that_arrives_late_is_not_owed_the_service_others_got_meanwhile():
    """The light tenant was served alone for 10 s; a heavy one starting from nothing then must
    not take the machine until its counter catches up (VTC's lift): the light one's P99 after
    the heavy one arrives stays within 1.2x its value alone."""
    alone, _ = ttft_p99(0.0, duration=20.0)
    late, _ = ttft_p99(40.0, duration=20.0, heavy_from=10.0)
    assert late["light"] <= 1.2 * alone["light"], (late, alone)


def test_a_tenant_on_a_clock_far_from_zero_is_served():
    """The served engine's clock is monotonic time, a day or more on a machine that has been up
    that long: the tenants' decay factor at the first step is then below the smallest float,
    and the first tenant's request must still run (no division by it)."""
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64))
    eng = LLMEngine(cfg, FakeExecutor(64, step_time=0.01), clock=SimClock())
    t = 200_000.0
    eng.add_request([1] * 8, SamplingParams(max_tokens=4, ignore_eos=True), now=t, tenant="alice")
    done = []
    while eng.has_unfinished:
        done += [o for o in eng.step(now=t).outputs if o.finished]
        t += 0.01
    assert [o.finish_reason for o in done] == ["length"] and len(done[0].token_ids) == 4
    eng.kv.check_all_free()


def _heavy_then_light(seats: int = 8, deadline_ms: float | None = None, queue: QueueConfig | None = None, **sched):
    """The heavy tenant runs 4 long requests; the light one, served once before, sends one more
    at t = 1 s. Returns (the engine, the light request's id, the heavy requests' ids)."""
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=4096),
                       scheduler=SchedulerConfig(max_num_seqs=seats, **sched), queue=queue or QueueConfig())
    eng = LLMEngine(cfg, FakeExecutor(4096, step_time=0.01), clock=SimClock())
    eng.add_request([1] * 16, SamplingParams(max_tokens=16, ignore_eos=True), now=0.0, tenant="light")
    heavy = [eng.add_request([1] * 16, SamplingParams(max_tokens=300, ignore_eos=True), now=0.0, tenant="heavy",
                             deadline_ms=deadline_ms if i == 0 else None).request_id for i in range(4)]
    t = 0.0
    while t < 1.0:
        eng.step(now=t)
        t += 0.01
    light = eng.add_request([2] * 16, SamplingParams(max_tokens=16, ignore_eos=True), now=t, tenant="light")
    while eng.has_unfinished:
        step = eng.step(now=t)
        assert step.ran is not None  # every step does work: a heavy request never waits in vain
        for o in step.outputs:
            assert not o.finished or o.finish_reason == "length"
        t += 0.01
    eng.kv.check_all_free()
    return eng, light.request_id, heavy


def _step_of_first_token(eng, rid: str) -> int:
    return next(i for i, b in enumerate(eng.executor.batches) if any(s.request_id == rid for s in b.seqs))


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
def test_a_tenant_served_less_has_its_first_token_step_to_itself(policy):
    """The light request's prompt runs in a step without the heavy tenant's decodes (it costs
    what it would alone); the heavy requests sit out that one step and no other."""
    eng, light, heavy = _heavy_then_light(policy=policy)
    i = _step_of_first_token(eng, light)
    ids = lambda b: {s.request_id for s in b.seqs}
    assert ids(eng.executor.batches[i]) == {light}
    assert set(heavy) <= ids(eng.executor.batches[i - 1]) and set(heavy) <= ids(eng.executor.batches[i + 1])
    with_heavy = [set(heavy) <= ids(b) for b in eng.executor.batches]
    last = len(with_heavy) - 1 - with_heavy[::-1].index(True)
    assert with_heavy[:last + 1].count(False) == 1  # the one step it sat out


def test_a_request_with_a_deadline_does_not_sit_out():
    eng, light, heavy = _heavy_then_light(deadline_ms=60_000.0)
    ids = {s.request_id for s in eng.executor.batches[_step_of_first_token(eng, light)].seqs}
    assert ids == {light, heavy[0]}


def test_requests_in_a_level_with_a_time_per_token_target_do_not_sit_out():
    eng, light, heavy = _heavy_then_light(queue=QueueConfig(levels=(LevelConfig("all", tpot_ms=50.0),)))
    ids = {s.request_id for s in eng.executor.batches[_step_of_first_token(eng, light)].seqs}
    assert ids == {light, *heavy}


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
def test_when_the_light_request_cannot_start_no_one_sits_out(policy):
    """Seats full and fairness preemption off (no priority gap): the light request waits for a
    seat, and the heavy requests decode every step meanwhile."""
    eng, light, heavy = _heavy_then_light(seats=4, preempt_gap=0, policy=policy)
    i = _step_of_first_token(eng, light)
    assert i > 101 and all(set(heavy) == {s.request_id for s in b.seqs} for b in eng.executor.batches[100:i])


# --- interjection: the light request starts between two layers of the step already running ------

class LayeredExecutor(FakeExecutor):
    """A FakeExecutor whose step takes `step_time` plus `per_token` a token, in `layers` equal
    layers, calling `between_layers` (when set) between each two with `at` the virtual time of
    that pause (the driver sets `at` to the step's start); as the model runner's, the hook
    returns the seconds it spent, which push the later pauses back. Its own steps run without it."""

    def __init__(self, *args, layers: int = 8, per_token: float = 0.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.layers, self.per_token, self.at, self.between_layers = layers, per_token, 0.0, None

    def execute(self, batch):
        took = self.step_time + self.per_token * batch.num_tokens
        out = super().execute(batch)
        out.step_time = took
        hook, self.between_layers = self.between_layers, None
        try:
            start, paused = self.at, 0.0
            for k in range(1, self.layers if hook is not None else 0):
                self.at = start + took * k / self.layers + paused
                paused += hook()
        finally:
            self.between_layers = hook
        return out


def _engine(seats: int = 8, per_token: float = 0.0, **sched) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=4096),
                       scheduler=SchedulerConfig(max_num_seqs=seats, **sched))
    return LLMEngine(cfg, LayeredExecutor(4096, step_time=0.01 if not per_token else 0.005, per_token=per_token),
                     clock=SimClock())


def _heavy_running(eng, deadline_ms: float | None = None, n: int = 4) -> tuple[float, list[str]]:
    """The heavy tenant's `n` long requests, run for 1 s (the light tenant served once before).
    Returns the time of the next step and their ids."""
    eng.add_request([2] * 16, SamplingParams(max_tokens=1), now=0.0, tenant="light")
    heavy = [eng.add_request([1] * 16, SamplingParams(max_tokens=400, ignore_eos=True), now=0.0, tenant="heavy",
                             deadline_ms=deadline_ms if i == 0 else None).request_id for i in range(n)]
    t = 0.0
    while t < 1.0:
        eng.executor.at = t
        eng.step(now=t)
        t += 0.01
    return t, heavy


def _light_mid_step(eng, t: float) -> tuple[str, list]:
    """One step at `t` during which (at its first pause) the light tenant sends a request, and
    the engine is asked for an interjection there. Returns the light request's id and what
    interject() returned."""
    got, rid = [], []

    def pause() -> float:
        if rid:
            return 0.0
        rid.append(eng.add_request([2] * 16, SamplingParams(max_tokens=16, ignore_eos=True),
                                   now=eng.executor.at, tenant="light").request_id)
        got.append(eng.interject(now=eng.executor.at))
        return got[0].ran.step_time if got[0] is not None else 0.0

    eng.executor.at, eng.executor.between_layers = t, pause
    eng.step(now=t)
    eng.executor.between_layers = None
    return rid[0], got


def _finish(eng, t: float) -> None:
    while eng.has_unfinished:
        eng.executor.at = t
        eng.step(now=t)
        t += 0.01
    eng.kv.check_all_free()


def test_a_light_request_arriving_mid_step_starts_between_its_layers():
    """It runs its first step inside the heavy step, at once: its first token one step after
    it arrived (what it costs alone), not after the rest of the running step as well. The
    paused step ends as it would have, one interjected step later, and the latency model is
    told each step's own time."""
    eng = _engine()
    seen = []
    observe = eng.scheduler.latency.observe
    eng.scheduler.latency.observe = lambda tokens, seqs, took: (seen.append(round(took, 9)), observe(tokens, seqs, took))
    t, heavy = _heavy_running(eng)
    n = len(eng.executor.batches)
    seen.clear()
    light, (step,) = _light_mid_step(eng, t)
    outer, inner = eng.executor.batches[n:]
    assert {s.request_id for s in outer.seqs} == set(heavy) and [s.request_id for s in inner.seqs] == [light]
    (out,) = step.outputs
    assert out.request_id == light and out.first_token_time - out.arrival_time == pytest.approx(0.01)
    assert out.arrival_time == pytest.approx(t + 0.00125)
    assert all(eng.scheduler.requests[h].last_token_time == pytest.approx(t + 0.02) for h in heavy)
    assert seen == [0.01, 0.01]  # the interjected step's, then the paused step's own
    assert eng.scheduler.num_interjections == 1
    _finish(eng, t + 0.02)


def test_with_every_seat_taken_an_interjection_takes_the_seat_the_next_step_would_give():
    """Seats full of the heavy tenant's requests: the interjected step preempts one of them (the
    fairness victim, keeping its blocks) for the light request's seat; the token that request
    had in flight is dropped and computed again when it resumes, so every answer comes out as
    it would have."""
    eng = _engine(seats=4)
    t, heavy = _heavy_running(eng)
    n = len(eng.executor.batches)
    light, (step,) = _light_mid_step(eng, t)
    assert step is not None and [s.request_id for s in eng.executor.batches[n + 1].seqs] == [light]
    (victim,) = [r for r in map(eng.scheduler.requests.get, heavy) if r.status.name != "RUNNING"]
    assert victim.status.name == "WAITING" and eng.kv.has(victim.request_id)  # kept its blocks
    assert eng.scheduler.waiting.stats(t).preemptions["fairness"] == 1
    outs = {}
    while eng.has_unfinished:
        t += 0.02
        eng.executor.at = t
        outs.update({o.request_id: o for o in eng.step(now=t).outputs if o.finished})
    for rid in heavy:  # FakeExecutor's token follows from its position: a lost or doubled one would show
        assert outs[rid].token_ids == [p % 1000 + 3 for p in range(16, 416)], rid
    eng.kv.check_all_free()


@pytest.mark.parametrize("case", ["deadline", "priority", "prompt", "seats", "off"])
def test_no_interjection_when_a_request_in_flight_may_not_wait_or_none_is_wanted(case):
    """In flight a request with a deadline, or of a higher priority than the light request, or
    the light tenant's own prompt; or no free seat and no preemption for fairness (no priority
    gap), or the switch off: the step runs to its end and the light request goes on as before."""
    eng = _engine(seats=4 if case == "seats" else 8, interject=case != "off", preempt_gap=0 if case == "seats" else 1)
    t, heavy = _heavy_running(eng, deadline_ms=60_000.0 if case == "deadline" else None)
    if case in ("priority", "prompt"):
        eng.add_request([2] * 16, SamplingParams(max_tokens=400, ignore_eos=True), now=t, priority=9 if case == "priority"
                        else 5, tenant="heavy" if case == "priority" else "light")
    n = len(eng.executor.batches)
    light, got = _light_mid_step(eng, t)
    assert got == [None] and len(eng.executor.batches) == n + 1 and eng.scheduler.num_interjections == 0
    _finish(eng, t + 0.01)


def test_interjections_under_random_arrivals_lose_nothing():
    """Both tenants arriving at random, within steps too, the light one interjecting where it
    may; steps cost 5 ms plus 0.25 ms a token, the heavy tenant sends 4x the light one's tokens
    in longer prompts. Every request ends exactly once with its answer, every block comes back,
    and the light tenant's P99 time to first token is within 1.2x its value alone, where without
    interjection it waits for the heavy prompts' steps."""

    def run(heavy_rate: float, interject: bool) -> tuple[float, int]:
        eng = _engine(seats=16, per_token=0.00025, interject=interject)
        ex = eng.executor
        rng = random.Random(7)
        arrivals = sorted((t, name) for name, rate in (("light", 10.0), ("heavy", heavy_rate)) if rate
                          for t in _poisson(rng, rate, 20.0))
        who, done, i, t = {}, {}, 0, 0.0

        def take(now: float) -> None:
            nonlocal i
            while i < len(arrivals) and arrivals[i][0] <= now:
                at, name = arrivals[i]
                i += 1
                rid = eng.add_request([1] * (16 if name == "light" else 128), SamplingParams(max_tokens=16, ignore_eos=True),
                                      now=at, tenant=name).request_id
                who[rid] = name

        def collect(outs) -> None:
            for o in outs:
                if o.finished:
                    assert o.request_id not in done and o.finish_reason == "length" and len(o.token_ids) == 16
                    done[o.request_id] = o

        extra = []

        def pause() -> float:
            take(ex.at)
            spent = 0.0
            while (step := eng.interject(now=ex.at + spent)) is not None:  # as many as are due
                spent += step.ran.step_time
                collect(step.outputs)
            extra.append(spent)
            return spent

        ex.between_layers = pause
        while i < len(arrivals) or eng.has_unfinished:
            take(t)
            extra.clear()
            ex.at = t
            step = eng.step(now=t)
            collect(step.outputs)
            t += (step.ran.step_time if step.ran is not None else 0.001) + sum(extra)
        assert set(done) == set(who)
        eng.kv.check_all_free()
        light = [o.first_token_time - o.arrival_time for rid, o in done.items() if who[rid] == "light"]
        return 1000 * percentile(light, 99), eng.scheduler.num_interjections

    alone, _ = run(0.0, True)
    shared, n = run(8.9, True)  # 144 tokens a request against the light one's 32: 4x its tokens
    without, _ = run(8.9, False)
    assert n > 0 and shared <= 1.2 * alone < without, (alone, shared, without, n)


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out






