"""Cost models: the roofline's formulas on hand-checked numbers, named shapes against their
published parameter counts, config.json loading, and the profiled model's arithmetic."""
from __future__ import annotations

import json

import pytest

from batchserve.core.latency import TERMS, ProfiledLatencyModel
from batchserve.core.batch import ScheduledBatch, ScheduledSeq
from batchserve.request import SamplingParams
from batchserve.sim.cost import RooflineCost, StepShape, make_cost_model
from batchserve.sim.hardware import GPUS, MODELS, get_model

P = SamplingParams()


def decode(b: int, ctx: int) -> ScheduledBatch:
    return ScheduledBatch([ScheduledSeq(f"d{i}", [5], ctx, [], True, P, 1) for i in range(b)])


def prefill(n: int, start: int = 0, sample: bool = True) -> ScheduledBatch:
    return ScheduledBatch([ScheduledSeq("p", [5] * n, start, [], sample, P, 0)])


@pytest.mark.parametrize("name, billions", [("llama-2-7b", 6.74), ("llama-3-8b", 8.03), ("llama-2-13b", 13.0),
                                            ("smollm2-135m", 0.135)])
def test_named_shapes_have_their_published_sizes(name: str, billions: float) -> None:
    assert MODELS[name].num_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_decode_of_one_is_bound_by_reading_the_weights() -> None:
    c = RooflineCost("a100-80gb", "llama-2-7b")
    m, g = c.model, c.gpu
    weights = (m.linear_params + m.head_params) * 2 / (g.mem_bw * g.eff_mem)
    kv = 100 * m.kv_bytes_per_token(2) / (g.mem_bw * g.eff_mem)  # 99 cached + 1 new token
    assert c.step_time(decode(1, 99)) == pytest.approx(g.step_overhead_s + weights + kv)
    assert 0.009 < c.step_time(decode(1, 99)) < 0.012  # ~13.5 GB at ~1.6 TB/s, plus 2 ms


def test_big_prefill_is_bound_by_flops() -> None:
    c = RooflineCost("a100-80gb", "llama-2-7b")
    m, g = c.model, c.gpu
    n = 4096
    lin = (2 * n * m.linear_params + 2 * m.head_params) / (g.peak_flops * g.eff_matmul)
    attn = 4 * m.num_layers * m.num_heads * m.head_dim * n * (n + 1) / 2 / (g.peak_flops * g.eff_attn)
    assert c.step_time(prefill(n)) == pytest.approx(g.step_overhead_s + lin + attn)


def test_step_shape_counts_context_and_causal_pairs() -> None:
    b = ScheduledBatch(prefill(4, start=10, sample=False).seqs + decode(2, 7).seqs)
    s = StepShape.of(b)
    assert (s.num_tokens, s.num_seqs, s.num_sampled, s.context_tokens) == (6, 3, 2, 14 + 8 + 8)
    assert s.attn_pairs == 4 * (10 + 2.5) + 2 * (7 + 1)


def test_faster_hardware_and_bigger_batches_behave() -> None:
    a100, h100, h200 = (RooflineCost(g, "llama-2-7b") for g in ("a100-80gb", "h100", "h200"))
    for b in (1, 64, 256):
        assert h200.step_time(decode(b, 500)) < h100.step_time(decode(b, 500)) < a100.step_time(decode(b, 500))
    times = [a100.step_time(decode(b, 500)) for b in (1, 8, 64, 256)]
    assert times == sorted(times)
    per_token = [t / b for t, b in zip(times, (1, 8, 64, 256))]
    assert per_token == sorted(per_token, reverse=True)  # batching amortises the weights


def test_kv_capacity_from_memory_left_after_weights() -> None:
    c = RooflineCost("a100-80gb", "llama-2-7b")
    free = 80e9 * 0.9 - c.model.num_params * 2 - 1.5e9
    assert c.num_blocks(16) == int(free // (16 * 2 * 32 * 32 * 128 * 2))
    assert 100_000 < c.num_blocks(16) * 16 < 120_000  # ~0.5 MiB per token, ~57 GB free
    gqa = RooflineCost("a100-80gb", "llama-3-8b")  # 8 KV heads: 4x fewer bytes per token
    assert gqa.num_blocks(16) > 3 * c.num_blocks(16)
    assert RooflineCost("h200", "llama-2-13b").num_blocks(16) > RooflineCost("a100-40gb", "llama-2-13b").num_blocks(16)
    with pytest.raises(ValueError, match="does not fit"):
        RooflineCost("a100-40gb", "llama-2-13b", elem_bytes=4).num_blocks(16)


def test_any_hf_config_json(tmp_path) -> None:
    m = MODELS["llama-3-8b"]
    cfg = {"vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
           "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
           "num_key_value_heads": m.num_kv_heads, "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for path in (str(tmp_path), str(tmp_path / "config.json")):
        shape = get_model(path)
        assert shape.num_params == m.num_params and shape.max_position_embeddings == 8192
    assert get_model("llama-2-7b", max_model_len=8192).max_position_embeddings == 8192
    with pytest.raises(ValueError, match="unknown"):
        get_model("no-such-model")
    with pytest.raises(ValueError, match="hardware"):
        RooflineCost("tpu-v9", "llama-2-7b")
    assert set(GPUS) >= {"a100-40gb", "a100-80gb", "h100", "h200"}


def test_profiled_cost_evaluates_the_profile(tmp_path) -> None:
    coef = {"const": 0.002, "prefill_token": 1e-5, "decode_seq": 3e-4, "decode_ktoken": 2e-4, "prefill_mpair": 0.05}
    prof = {"fit": {"coef": coef, "context_len": 128}, "max_model_len": 2048, "num_blocks": 321,
            "kv_bytes_per_token": 1024}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    cost = make_cost_model(profile=str(path))
    b = ScheduledBatch(prefill(100, start=20, sample=False).seqs + decode(3, 500).seqs)
    want = 0.002 + 1e-5 * 100 + 3e-4 * 3 + 2e-4 * 1.5 + 0.05 * 100 * 120 / 1e6
    assert cost.step_time(b) == pytest.approx(want)
    assert cost.max_model_len == 2048 and cost.num_blocks(16) == 321
    scaled = make_cost_model(profile=str(path), kv_cache_gb=1.0, overhead_s=0.001, scale=2.0)
    assert scaled.step_time(b) == pytest.approx(2 * want + 0.001)
    assert scaled.num_blocks(16) == 2**30 // (1024 * 16)
    # decode-only steps and steps with prompt tokens scaled apart
    dec = ScheduledBatch(decode(3, 500).seqs)
    apart = make_cost_model(profile=str(path), scale=0.8, prompt_scale=1.25)
    assert apart.step_time(dec) == pytest.approx(0.8 * cost.step_time(dec))
    assert apart.step_time(b) == pytest.approx(1.25 * want)


def test_one_token_of_prompt_padding_is_a_prompt_chunk_not_a_decode(tmp_path) -> None:
    """Paid padding: two prompts one token apart leave a one-token prompt row, which samples
    nothing and is priced as a prompt chunk; a finished member's decode row samples."""
    from batchserve.core.batch import PadRow

    coef = {"const": 0.005, "prefill_token": 1e-4, "decode_seq": 1e-3, "prompt": 0.01, "mixed": 0.004}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"fit": {"coef": coef, "context_len": 128}, "num_blocks": 64}))
    cost = make_cost_model(profile=str(path))
    pre = prefill(10, sample=False).seqs
    one, two = (cost.step_time(ScheduledBatch(pre, padding=[PadRow(9, n, False)])) for n in (1, 2))
    assert one == pytest.approx(0.005 + 11e-4 + 0.01) and two - one == pytest.approx(1e-4)
    dec = cost.step_time(ScheduledBatch(decode(2, 100).seqs, padding=[PadRow(50, 1, True)]))
    assert dec == pytest.approx(0.005 + 3e-3)  # three decode rows, no prompt


def test_a_profile_prices_the_prompt_path_and_mixed_steps(tmp_path) -> None:
    coef = {"const": 0.005, "decode_seq": 1e-3, "prompt": 0.01, "mixed": 0.004}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"fit": {"coef": coef, "context_len": 128}, "num_blocks": 64}))
    cost = make_cost_model(profile=str(path))
    pre, dec = prefill(10, sample=False).seqs, decode(2, 100).seqs
    assert cost.step_time(ScheduledBatch(dec)) == pytest.approx(0.005 + 2e-3)
    assert cost.step_time(ScheduledBatch(pre)) == pytest.approx(0.005 + 0.01)
    assert cost.step_time(ScheduledBatch(pre + dec)) == pytest.approx(0.005 + 2e-3 + 0.01 + 0.004)
    model = ProfiledLatencyModel(coef={t: coef.get(t, 0.0) for t in TERMS})  # the scheduler's view, by counts
    assert model.predict_step(2, 2) == pytest.approx(0.007) and model.predict_step(10, 1) == pytest.approx(0.015)
    assert model.predict_step(12, 3) == pytest.approx(0.021) == model.predict_step(12, 3, context=300)
