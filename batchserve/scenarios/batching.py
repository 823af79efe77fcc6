"""Batching scenarios: request-level vs token-level batching on a mixed load, and static vs continuous
vs continuous + cascaded batching on short requests with a few long ones."""
from __future__ import annotations

from batchserve.bench.workload import WorkItem, make_workload
from batchserve.scenarios import SIM, Backend, Row, ScenarioResult, require
from batchserve.scenarios.common import GPU, MODEL, SATURATION_RATE, e2e, engine, rate_of
from batchserve.sim.cost import RooflineCost
from batchserve.sim.simulator import SimResult

LOAD = 0.7  # offered load for the latency runs, as a share of the baseline's saturation throughput


def useful(res: SimResult) -> float:
    """Tokens the answers needed (each completed request's prompt and all but its last output
    token) over tokens computed, counting a padded batch's padding and recomputation after
    preemption as waste."""
    need = sum(r.prompt_tokens + r.output_tokens - 1 for r in res.records if r.ok and r.output_tokens)
    st = res.engine_stats
    return need / (st["tokens_computed"] + st["padding_tokens"])


def tokens_per_s(res: SimResult) -> float:
    return res.summary["output_tokens_per_s"]


# --- mixed-granularity ---------------------------------------------------------------------
def mixed_granularity(requests: int | None, seed: int, backend: Backend = SIM) -> ScenarioResult:
    require("static", "chunked")
    # a 5,000-token summary needs more than Llama-2-7B's 4,096
    run = backend.runner(lambda: RooflineCost(GPU, MODEL, max_model_len=8192))
    n = requests or backend.requests(600)
    req_level = engine("static", window_ms=50.0, max_batch=16)
    req_paid = engine("static", window_ms=50.0, max_batch=16, pay_padding=True)
    tok_level = engine("chunked", chunk_size=512)

    def load(rate: float) -> list[WorkItem]:
        return make_workload("mixed", n, rate, seed=seed, scale=backend.scale)

    sat_r, sat_t = run(req_level, load(SATURATION_RATE), None), run(tok_level, load(SATURATION_RATE), None)
    sat_p = run(req_paid, load(SATURATION_RATE), None)
    rate = LOAD * rate_of(sat_r)
    run_r, run_t = run(req_level, load(rate), None), run(tok_level, load(rate), None)
    rows = [Row("useful share of computed tokens", 0.55, 0.82, useful(sat_r), useful(sat_t), better="higher",
                unit="%"),
            Row("throughput at saturation (x request level, padding accounted)", 1.0, 1.6, 1.0,
                rate_of(sat_t) / rate_of(sat_r), better="higher", unit="x"),
            Row("throughput at saturation (x request level, padding paid)", 1.0, 1.6, 1.0,
                rate_of(sat_t) / rate_of(sat_p), better="higher", unit="x"),
            Row(f"P99 E2E at {LOAD:.0%} of request-level capacity (ms)", 800, 520, e2e(run_r), e2e(run_t)),
            Row("output tokens/s at saturation", None, None, tokens_per_s(sat_r), tokens_per_s(sat_t),
                better="higher"),
            Row("output tokens/s at saturation, request level paying its padding", None, None,
                tokens_per_s(sat_p), tokens_per_s(sat_t), better="higher"),
            Row("chat-class P99 E2E under load (ms)", None, None, e2e(run_r, "chat"), e2e(run_t, "chat")),
            Row("preemptions at saturation (recompute)", None, None, sat_r.engine_stats["num_preemptions"],
                sat_t.engine_stats["num_preemptions"])]
    notes = [
        "Useful share = tokens the answers need / tokens computed. Request level loses to padding: a padded "
        "batch computes every member to the longest prompt and keeps every row until the longest output ends "
        "(batchserve accounts that padding exactly). Token level pads nothing, since chunks are ragged; what "
        "it can lose is recomputation after preemption.",
        "Padding accounted vs paid: by default request level runs its batches ragged and only counts the "
        "padding, so its times are a padded engine's less the padding's cost; the 'padding paid' rows run it "
        "with pay_padding, each step charged for the rows a padded engine would compute as well (prompts "
        "padded to the batch's longest, a decode row per finished member until the batch ends; "
        "sim/cost.py)."] + ([] if not backend.seed_hardware else [
        "Absolute latencies are seconds, not the seed's hundreds of ms: a 5,000-token prompt alone is ~0.4 s "
        "of prefill on an A100 at 7B, and 300-500 output tokens are 300-500 decode steps.",
        "Llama-2-7B's context is 4,096 tokens; the seed's 5,000-token summaries need a longer one, so this "
        "scenario gives the same 7B shape an 8,192-token context (step costs are unchanged)."])
    if backend.seed_hardware and sat_t.engine_stats["num_preemptions"] > sat_r.engine_stats["num_preemptions"]:
        notes.append(
            f"At saturation the token-level run preempted {sat_t.engine_stats['num_preemptions']} times: it "
            "starts a prompt only when the free blocks cover the whole prompt, but not its output, so when "
            "many admitted requests grow at once the cache (~108k tokens here) runs out and the least "
            "important are recomputed; request level reserves each member's prompt + output up front.")
    return ScenarioResult(
        "mixed-granularity", "request level vs token level on a mixed load (S3, seed 4.3.3)",
        [f"mixed mix at the seed's sizes: code-gen 2,000 in / 500 out, summaries 5,000 / 300, chat 200 / 200, "
         f"a third each{backend.lengths()}; {n} requests",
         "request level: static, batch 16, 50 ms window, results returned per batch; token level: chunked, "
         "512-token chunks, 4,096 tokens per step, decodes first; request level at saturation both with its "
         "padding accounted only and paid (pay_padding)",
         f"saturation: all requests at once; latency: Poisson at {LOAD:.0%} of the request-level saturation "
         f"throughput = {rate:.2f} req/s"],
        "request level", "token level", rows, notes,
        {"request-level-saturation": (SATURATION_RATE, sat_r), "token-level-saturation": (SATURATION_RATE, sat_t),
         "request-level-paid-saturation": (SATURATION_RATE, sat_p),
         "request-level": (rate, run_r), "token-level": (rate, run_t)}, backend.label)


# --- static-vs-continuous ------------------------------------------------------------------
def static_vs_continuous(requests: int | None, seed: int, backend: Backend = SIM) -> ScenarioResult:
    require("static", "continuous", "cascade")
    run = backend.runner(lambda: RooflineCost(GPU, MODEL))
    n = requests or backend.requests(2000)
    static = engine("static", window_ms=200.0, max_batch=32)
    cont = engine("continuous")
    casc = engine("cascade", prefill_max_batch=64, decode_max_batch=cont.scheduler.max_num_seqs)  # equal seats

    def load(rate: float) -> list[WorkItem]:
        return make_workload("short-long", n, rate, seed=seed, scale=backend.scale)

    sat_s = run(static, load(SATURATION_RATE), None)
    rate = LOAD * rate_of(sat_s)
    s, c, k = (run(cfg, load(rate), None) for cfg in (static, cont, casc))
    sat_c, sat_k = run(cont, load(SATURATION_RATE), None), run(casc, load(SATURATION_RATE), None)
    step_ms = 1000.0 * c.busy_s / c.num_steps
    rows = [Row("short requests: mean E2E (ms)", 2500, 800, e2e(s, "short", "mean"), e2e(c, "short", "mean")),
            Row("short requests: P99 E2E (ms)", 3000, 1200, e2e(s, "short"), e2e(c, "short")),
            Row("throughput at saturation, continuous -> + cascaded (x)", 1.0, 1.4, 1.0,
                tokens_per_s(sat_k) / tokens_per_s(sat_c), better="higher", unit="x"),
            Row("short requests under load, continuous -> + cascaded: P99 E2E (ms)", None, None, e2e(c, "short"),
                e2e(k, "short")),
            Row("long requests: P99 E2E (ms), static -> continuous", None, None, e2e(s, "long"), e2e(c, "long")),
            Row("output tokens/s at saturation, static -> continuous", None, None, tokens_per_s(sat_s),
                tokens_per_s(sat_c), better="higher")]
    notes = [] if not backend.seed_hardware else [
        f"One continuous step here takes {step_ms:.0f} ms on average (the seed: ~10 ms per iteration): a 7B "
        "decode step on an A100 reads ~13.5 GB of weights, ~8 ms at 80% of 2 TB/s, plus the KV cache and "
        "a fixed overhead.",
        "Cascaded batching runs prompt and decode steps apart, with as many decode seats as continuous has. On "
        "the roofline a mixed step reads the weights once for both kinds of rows, so it costs less than its "
        "parts run apart and splitting them cannot add throughput on one device; the seed's gain needs a machine "
        "where a mixed step costs more than its parts (prefill interference), or the stages on two devices.",
        "Static returns a batch's results together when its longest member ends (a 512-token long request "
        "holds 31 short ones); continuous returns each request when its own last token is out."]
    return ScenarioResult(
        "static-vs-continuous", "static 200 ms / 32 vs continuous vs continuous + cascaded (S4, seed 4.4.3)",
        [f"short-long mix: 90% short (prompt ~64 / output ~32), 10% long (64 / ~512){backend.lengths()}; {n} "
         "requests",
         "static: 200 ms window, batch 32, run to completion; continuous: up to 128 sequences; cascaded: "
         "prefill stage 64, decode stage 128 (continuous's seats)",
         f"latency runs: Poisson at {LOAD:.0%} of static's saturation throughput = {rate:.2f} req/s; "
         "throughput: all requests at once"],
        "static", "continuous", rows, notes,
        {"static": (rate, s), "continuous": (rate, c), "cascade": (rate, k),
         "static-saturation": (SATURATION_RATE, sat_s), "continuous-saturation": (SATURATION_RATE, sat_c),
         "cascade-saturation": (SATURATION_RATE, sat_k)}, backend.label)
