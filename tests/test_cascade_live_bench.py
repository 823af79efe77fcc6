"""The live cascade benchmark compares its layouts at equal seats, without a model."""
from __future__ import annotations

import pytest

from benchmarks.cascade_live import LAYOUTS, layout_args, main


def _flag(args: list[str], name: str) -> int | None:
    return int(args[args.index(name) + 1]) if name in args else None


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_runs_the_same_seats(name):
    args = layout_args(name, 64)
    replicas = _flag(args, "--replicas") or 1
    # requests running at once, over every engine that decodes
    decode = _flag(args, "--decode-max-batch") if "cascade" in args else _flag(args, "--max-num-seqs")
    assert decode * (replicas if "cascade" not in args else 1) == 64


def test_an_unknown_layout_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--layouts", "continuous,ray"])
    assert e.value.code == 2
    assert "--layouts: unknown ray" in capsys.readouterr().err
