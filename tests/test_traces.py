"""Public trace formats: each reader on a hand-written file, format sniffing, time-scaled
replay, Mooncake's shared prefixes, the bundled samples, and `bench` / `simulate` on them."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from batchserve.bench.traces import (SAMPLE_DIR, SAMPLES, read_azure, read_burstgpt, read_mooncake, replay_times,
                                     sample_path, sniff_format)
from batchserve.bench.workload import make_workload

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5.0,ChatGPT,120,40,160,Conversation log
5.5,GPT-4,800,0,800,API log
7.25,GPT-4,30,300,330,API log
"""
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,1020,129
2023-11-16 18:15:47.0000000,4000,13
2023-11-16 18:16:46.6805900,12,1
"""


@pytest.fixture()
def files(tmp_path):
    paths = {"burstgpt": tmp_path / "b.csv", "azure": tmp_path / "a.csv", "mooncake": tmp_path / "m.jsonl",
             "jsonl": tmp_path / "own.jsonl"}
    paths["burstgpt"].write_text(BURSTGPT)
    paths["azure"].write_text(AZURE)
    rows = [{"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 7]},
            {"timestamp": 4000, "input_length": 600, "output_length": 5, "hash_ids": [9, 10]}]
    paths["mooncake"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["jsonl"].write_text(json.dumps({"timestamp": 0, "prompt_len": 4, "max_tokens": 2}) + "\n")
    return {k: str(v) for k, v in paths.items()}


def test_readers_and_sniffing(files, tmp_path):
    for fmt, path in files.items():
        assert sniff_format(path) == fmt
    b = read_burstgpt(files["burstgpt"])
    assert [(r.timestamp, r.prompt_len, r.output_len, r.cls) for r in b] == \
           [(5.0, 120, 40, "conversation"), (7.25, 30, 300, "api")]  # the failed (0-response) row is skipped
    a = read_azure(files["azure"])
    assert [r.timestamp - a[0].timestamp for r in a] == pytest.approx([0.0, 0.31941, 60.0])
    assert [(r.prompt_len, r.output_len) for r in a] == [(1020, 129), (4000, 13), (12, 1)]
    m = read_mooncake(files["mooncake"])
    assert [r.timestamp for r in m] == [1.0, 1.5, 4.0] and m[1].hash_ids == (1, 2, 7)
    assert len(read_mooncake(files["mooncake"], n=2)) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="not a trace format"):
        sniff_format(str(bad))
    bad.write_text(AZURE.replace("1020", "many"))
    with pytest.raises(ValueError, match="ContextTokens must be a number"):
        read_azure(str(bad))
    bad.write_text('{"timestamp": 1, "input_length": 3}\n')
    with pytest.raises(ValueError, match="Mooncake"):
        make_workload(str(bad), 0, 0.0, trace_format="mooncake")


OWN = {"timestamp": 0, "prompt_len": 4, "max_tokens": 2}


@pytest.mark.parametrize("line, says", [
    ('{"timestamp": 1e400, "prompt_len": 4, "max_tokens": 2}', ":2: timestamp must be a finite number"),
    ('{"timestamp": NaN, "prompt_len": 4, "max_tokens": 2}', ":2: timestamp must be a finite number"),
    ('{"timestamp": "soon", "prompt_len": 4, "max_tokens": 2}', ":2: timestamp must be a number"),
    ("[1, 2]", ":2: expected a JSON object"),
    ('{"timestamp": 1, "prompt": 12345, "max_tokens": 2}', ":2: prompt must be a string"),
    ('{"timestamp": 1, "prompt_len": "abc", "max_tokens": 2}', ":2: prompt_len must be a number"),
    ('{"timestamp": 1, "prompt_len": 4, "max_tokens": -5}', ":2: max_tokens must be a finite number >= 1"),
    ('{"timestamp": 1, "prompt_len": 4, "max_tokens": 2, "priority": 99}', ":2: priority"),
    ('{"timestamp": 1, "prompt_len": 4, "max_tokens": 2, "deadline_kind": "maybe"}', ":2: deadline_kind must be one of"),
    ('{"timestamp": 1, "prompt_len": 4, "max_tokens": 2, "deadline_ms": -100}', ":2: deadline_ms must be > 0"),
])
def test_a_bad_jsonl_line_is_refused_by_file_line_and_field(tmp_path, line, says):
    """A trace is user input: a value the replay could not honour (a time that never comes, a
    priority the server refuses) is refused when the file is read, not sent to fail later."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(OWN) + "\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        make_workload(str(path), 0, 0.0)
    assert str(e.value).startswith(str(path) + says)


@pytest.mark.parametrize("fmt, text", [
    ("burstgpt", BURSTGPT.replace("7.25,", "inf,")), ("burstgpt", BURSTGPT.replace("7.25,", "nan,")),
    ("mooncake", '{"timestamp": 1e400, "input_length": 3, "output_length": 2}\n'),
])
def test_public_formats_refuse_a_time_that_is_not_finite(tmp_path, fmt, text):
    path = tmp_path / "t.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match="must be a finite number"):
        make_workload(str(path), 0, 0.0, trace_format=fmt)
    with pytest.raises(ValueError, match="finite"):
        replay_times(np.array([0.0, np.inf]))


def test_replay_is_time_scaled_or_stretched(files):
    assert replay_times(np.array([10.0, 11.0, 14.0]), time_scale=0.5).tolist() == [0.0, 0.5, 2.0]
    assert replay_times(np.array([10.0, 11.0, 14.0]), rate=3.0).tolist() == pytest.approx([0.0, 0.25, 1.0])
    with pytest.raises(ValueError, match="not both"):
        replay_times(np.array([0.0, 1.0]), rate=1.0, time_scale=2.0)
    items = make_workload(files["azure"], 0, 0.0, time_scale=0.1)
    assert [w.arrival for w in items] == pytest.approx([0.0, 0.031941, 6.0])
    assert [(w.prompt_len, w.max_tokens) for w in items] == [(1020, 129), (4000, 13), (12, 1)]
    half = make_workload(files["burstgpt"], 0, 0.0, scale=0.5, seed=1)
    assert [(w.prompt_len, w.max_tokens, w.cls, w.arrival) for w in half] == \
           [(60, 20, "conversation", 0.0), (15, 150, "api", 2.25)]
    assert len(half[0].prompt_token_ids) == 60
    own = make_workload(files["jsonl"], 0, 0.0, time_scale=2.0)  # batchserve's JSONL takes a time scale too
    assert own[0].prompt_len == 4
    with pytest.raises(ValueError, match="for traces"):
        make_workload("chat", 5, 1.0, time_scale=2.0)


def test_mooncake_requests_sharing_hash_ids_share_prompt_prefixes(files):
    items = make_workload(files["mooncake"], 0, 0.0, scale=0.1, seed=3)  # blocks of round(512 x 0.1) = 51 tokens
    a, b, c = (w.prompt_token_ids for w in items)
    assert [len(a), len(b), len(c)] == [110, 150, 60]
    assert a[:102] == b[:102]  # hash ids 1, 2 in common: two blocks
    assert a[102:110] != b[102:110]  # block 3 against block 7
    assert not set(zip(c, c[1:])) & set(zip(a, a[1:]))  # no block in common: nothing alike
    again = make_workload(files["mooncake"], 0, 0.0, scale=0.1, seed=3)
    assert [w.prompt_token_ids for w in again] == [a, b, c]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_bundled_samples_replay(name):
    assert os.path.isfile(sample_path(name))
    items = make_workload(name, 0, 0.0, scale=0.1)
    assert len(items) >= 200 and all(w.prompt_len >= 1 and w.max_tokens >= 1 for w in items)
    assert all(x.arrival <= y.arrival for x, y in zip(items, items[1:])) and items[0].arrival == 0.0
    fast = make_workload(name, 50, 20.0, scale=0.1)
    assert len(fast) == 50 and 50 / fast[-1].arrival == pytest.approx(20.0)


def test_samples_follow_the_shapes_their_readme_states():
    assert "synthetic" in open(os.path.join(SAMPLE_DIR, "README.md")).read()
    code, conv = read_azure(sample_path("azure-code")), read_azure(sample_path("azure-conv"))
    assert np.median([r.prompt_len for r in code]) == pytest.approx(1500, rel=0.2)
    assert np.median([r.output_len for r in code]) == pytest.approx(13, rel=0.3)
    assert np.median([r.prompt_len for r in conv]) == pytest.approx(1020, rel=0.2)
    assert np.median([r.output_len for r in conv]) == pytest.approx(129, rel=0.25)
    moon = read_mooncake(sample_path("mooncake"))
    assert np.mean([r.prompt_len for r in moon]) == pytest.approx(7600, rel=0.25)
    assert all(len(r.hash_ids) == -(-r.prompt_len // 512) for r in moon)
    firsts = [r.hash_ids[0] for r in moon]
    assert max(firsts.count(h) for h in set(firsts)) >= 20  # a popular shared prefix
    gaps = np.diff([r.timestamp for r in read_burstgpt(sample_path("burstgpt"))])
    assert gaps.var() / gaps.mean() ** 2 > 2  # bursty: far from Poisson's CV^2 of 1


def test_simulate_and_bench_take_a_trace(capsys):
    from batchserve.cli import main

    assert main(["simulate", "--trace", "burstgpt", "--requests", "60", "--scale", "0.2", "--time-scale", "0.05",
                 "--slo", "ttft_ms=2000"]) == 0
    out = capsys.readouterr().out
    assert "burstgpt x 60 at time scale 0.05" in out and " api " in out and "conversation" in out
    assert main(["simulate", "--trace", "burstgpt", "--requests", "60", "--scale", "0.2"]) == 0  # its own timing
    own = capsys.readouterr().out
    items = make_workload("burstgpt", 60, 0.0)
    assert f"burstgpt x 60 at its own timing ({60 / items[-1].arrival:.3g} req/s offered)" in own
    assert main(["bench", "--url", "http://127.0.0.1:9", "--trace", "nope.csv"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--trace", "mooncake", "--time-scale", "0.1",
                 "--rates", "2"]) == 1
    assert "--time-scale" in capsys.readouterr().err


@pytest.mark.model
def test_mooncake_text_prompts_share_prefixes(files):
    from transformers import AutoTokenizer

    from batchserve.runner.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    a, b, _ = make_workload(files["mooncake"], 0, 0.0, scale=0.1, seed=3, tokenizer=tok)
    ia, ib = (tok.encode(w.prompt, add_special_tokens=False) for w in (a, b))
    assert (len(ia), len(ib)) == (a.prompt_len, b.prompt_len) == (110, 150)
    assert ia[:102] == ib[:102] and ia[:110] != ib[:110]
