"""The seed's e-commerce case, scaled to a fake executor with a fixed 10 ms
step: a 3x overload in which 30% of the requests are low-value bulk work (long documents,
128-token prompts) and 70% are short high-value ones (16 tokens, a 300 ms hard deadline).

FIFO: one level, one priority for everyone, no urgent lane, and no deadline the server knows of
(with deadlines it would take the earliest first) — high-value requests wait behind the flood; a
high-value answer later than 300 ms counts as a timeout there too. Levels: high / normal / low with caps, `drop_oldest` for low. The high level's P99
wait must be at least 3x lower with levels and its timeout rate near zero; low-priority
latency is allowed to grow (here the FIFO's one deep queue makes everyone wait longer, so
low waits less with levels but loses more requests to drop_oldest). `pytest -s` prints the table.
"""
import random

from batchserve.config import CacheConfig, EngineConfig, LevelConfig, QueueConfig, SchedulerConfig
from batchserve.core.stats import percentile
from batchserve.engine.clock import SimClock
from batchserve.engine.engine import LLMEngine
from batchserve.request import OverloadedError, SamplingParams
from tests.conftest import FakeExecutor

STEP = 0.010
DURATION = 4.0
FIFO = QueueConfig(levels=(LevelConfig("all", capacity=400),), urgent_slack_ms=None)  # same total cap
LEVELS = QueueConfig(levels=(LevelConfig("high", tuple(range(7, 11)), capacity=100),
                             LevelConfig("normal", (4, 5, 6), capacity=100),
                             LevelConfig("low", (0, 1, 2, 3), capacity=200, overflow="drop_oldest")))


def engine(queue: QueueConfig) -> LLMEngine:
    cfg = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=4096), queue=queue,
                       scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=256))
    return LLMEngine(cfg, FakeExecutor(4096, step_time=STEP), clock=SimClock())


def capacity(seed: int = 3) -> float:
    """Requests/s the engine serves of this mix when saturated: a burst, drained FIFO."""
    rng, eng, n = random.Random(seed), engine(QueueConfig()), 500
    for _ in range(n):
        eng.add_request([1] * (128 if rng.random() < 0.3 else 16), SamplingParams(max_tokens=4), now=0.0)
    steps = 0
    while eng.has_unfinished:
        eng.step(now=steps * STEP)
        steps += 1
    return n / (steps * STEP)


def run(queue: QueueConfig, with_priorities: bool, rate: float, seed: int = 7) -> dict[str, dict[str, float]]:
    eng = engine(queue)
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < DURATION:
        t += rng.expovariate(rate)
        arrivals.append((t, "low" if rng.random() < 0.3 else "high"))
    cls_of, outs, refused = {}, {}, {"high": 0, "low": 0}
    now, i = 0.0, 0
    while i < len(arrivals) or eng.has_unfinished:
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, cls = arrivals[i]
            i += 1
            high = cls == "high"
            try:
                r = eng.add_request([1] * (16 if high else 128), SamplingParams(max_tokens=4), now=at,
                                    priority=(9 if high else 1) if with_priorities else 5,
                                    deadline_ms=300 if high and with_priorities else None,
                                    deadline_kind="hard")
                cls_of[r.request_id] = cls
            except OverloadedError:
                refused[cls] += 1
        for o in eng.step(now=now).outputs:
            if o.finished:
                outs[o.request_id] = o
        now += STEP
    table = {}
    for cls in ("high", "low"):
        mine = [o for rid, o in outs.items() if cls_of[rid] == cls]
        n = len(mine) + refused[cls]
        # wait = arrival -> first scheduled; one that never ran waited until it ended
        waits = [1000 * ((o.first_scheduled_time or o.finish_time) - o.arrival_time)
                 for o in mine if o.finish_reason != "rejected"]
        e2e = [1000 * (o.finish_time - o.arrival_time) for o in mine if o.finish_reason == "length"]
        table[cls] = {
            "requests": n, "wait_p50_ms": percentile(waits, 50), "wait_p99_ms": percentile(waits, 99),
            "e2e_p99_ms": percentile(e2e, 99),
            "timeout_rate": sum(o.finish_reason == "deadline" or (
                cls == "high" and o.finish_reason == "length" and o.finish_time - o.arrival_time > 0.3)
                for o in mine) / n,
            "refused_or_dropped": (refused[cls] + sum(o.finish_reason == "rejected" for o in mine)) / n,
            "served": len(e2e) / n}
    eng.kv.check_all_free()
    return table


def test_levels_protect_high_value_traffic():
    cap = capacity()
    fifo, levels = run(FIFO, False, 3 * cap), run(LEVELS, True, 3 * cap)
    cols = ["requests", "wait_p50_ms", "wait_p99_ms", "e2e_p99_ms", "timeout_rate", "refused_or_dropped",
            "served"]
    print(f"\n3x overload ({3 * cap:.0f} requests/s, capacity {cap:.0f}/s), 30% low-value bulk requests, "
          f"{DURATION:.0f} s virtual, {STEP * 1000:.0f} ms steps")
    print(f"{'queue':8}{'class':6}" + "".join(f"{c:>20}" for c in cols))
    for name, tab in (("fifo", fifo), ("levels", levels)):
        for cls in ("high", "low"):
            row = tab[cls]
            print(f"{name:8}{cls:6}" + "".join(
                f"{row[c]:>20.1%}" if c in ("timeout_rate", "refused_or_dropped", "served") else f"{row[c]:>20.0f}"
                for c in cols))
    hi_f, hi_l = fifo["high"], levels["high"]
    assert hi_f["timeout_rate"] > 0.05  # the problem is real under FIFO
    assert hi_l["wait_p99_ms"] * 3 <= hi_f["wait_p99_ms"]
    assert hi_l["timeout_rate"] <= 0.01 and hi_l["refused_or_dropped"] <= 0.01
    assert levels["low"]["served"] >= 0.05  # low pays (waits, drops) but is not shut out


def test_the_seed_levels_never_cost_the_high_class():
    """The same flood through one level and through the seed's three levels: the high class waits
    no longer with levels, whether or not the low requests carry deadlines tight enough to be
    promoted by slack (which levels keep inside the low level; tests/test_queue.py); without
    such deadlines the two layouts schedule alike."""
    rate = 2 * capacity()

    def high_wait_p99(queue: QueueConfig, low_deadline: float | None) -> float:
        eng = engine(queue)
        rng = random.Random(11)
        t, waits, cls = 0.0, [], {}
        arrivals = []
        while t < 2.0:
            t += rng.expovariate(rate)
            arrivals.append(t)
        i, now = 0, 0.0
        while i < len(arrivals) or eng.has_unfinished:
            while i < len(arrivals) and arrivals[i] <= now:
                high = rng.random() < 0.2
                r = eng.add_request([1] * 16, SamplingParams(max_tokens=4), now=arrivals[i], priority=9 if high else 1,
                                    deadline_ms=None if high else low_deadline, deadline_kind="soft")
                cls[r.request_id] = high
                i += 1
            for o in eng.step(now=now).outputs:
                if o.finished and cls[o.request_id] and o.first_scheduled_time is not None:
                    waits.append(o.first_scheduled_time - o.arrival_time)
            now += STEP
        return percentile(waits, 99)

    seed = QueueConfig(levels=tuple(LevelConfig(lv.name, lv.priorities) for lv in LEVELS.levels))
    one = QueueConfig()
    for low_deadline in (None, 100.0):
        a, b = high_wait_p99(one, low_deadline), high_wait_p99(seed, low_deadline)
        assert b <= a, (low_deadline, a, b)
        if low_deadline is None:
            assert a == b
