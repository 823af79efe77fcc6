"""`benchmarks.prompt_steps.mix`: prompt steps against the machine's local speed, by composition.
Synthetic runs, no model: the drift must cancel and the composition must show."""
import math

import pytest

from benchmarks.prompt_steps import MIX_WINDOW_S, format_mix, mix


def run(speed, factor, seconds=20.0, dt=0.01, every=50):
    """Decode-only steps every `dt` at `speed(t)` x their 10 ms prediction; every `every`-th step
    carries one prompt of 100 tokens with k = (its index // every) % 20 decodes, taking
    `factor(k)` x speed(t) x its 50 ms prediction."""
    steps, i, t = [], 0, 0.0
    while t < seconds:
        if i % every == every - 1:
            k = (i // every) % 20
            steps.append((t, 1, 100, k, 0.05 * speed(t) * factor(k), 0.05))
        else:
            steps.append((t, 0, 0, 4, 0.01 * speed(t), 0.01))
        t += dt
        i += 1
    return steps


def by_decodes(m):
    return {(lo, hi): r for lo, hi, _, r in m["decodes"]}


def test_drift_cancels_and_composition_shows():
    # the machine slows from 1x to 2x over the run: summed ratios would mix the two ends
    drifting = run(lambda t: 1.0 + t / 20, lambda k: 1.2 if k < 8 else 0.9)
    got = by_decodes(mix([drifting]))
    assert got[(0, 0)] == pytest.approx(1.2, rel=0.02)
    assert got[(4, 7)] == pytest.approx(1.2, rel=0.02)
    assert got[(8, 15)] == pytest.approx(0.9, rel=0.02)
    assert got[(16, math.inf)] == pytest.approx(0.9, rel=0.02)
    m = mix([drifting])
    assert [(lo, hi) for lo, hi, *_ in m["prompts"]] == [(1, 1)]  # no bucket without steps
    assert m["prompt tokens"][0][:2] == (65, 128) and "tokens 65-128: " in format_mix("x", m)
    assert "decodes 0: " in format_mix("x", m) and "1-3: 1.200 (6)" in format_mix("x", m)


def test_runs_pool_but_windows_stay_in_their_run():
    # two runs over the same seconds at different speeds: a window crossing runs would blend them
    slow = run(lambda t: 3.0, lambda k: 1.1)
    fast = run(lambda t: 1.0, lambda k: 1.1)
    got = mix([slow, fast])
    assert sum(n for *_, n, _ in got["prompts"]) == sum(1 for s in slow + fast if s[2])
    for _, _, _, r in got["decodes"]:
        assert r == pytest.approx(1.1, rel=0.01)


def test_steps_without_enough_decode_neighbours_are_left_out():
    sparse = run(lambda t: 1.0, lambda k: 1.0, dt=MIX_WINDOW_S / 2, every=2)  # at most ~4 decodes within a window
    assert all(v == [] for v in mix([sparse]).values())
