"""n = 4 copies of a 1,000-token prompt on the real model, as four unrelated requests (prefix
caching off, then on) and as one group (prefilled once): end to end and the last copy's first
token. `python -m benchmarks.shared_prefill [rounds]`; results in BENCHMARKS.md."""
import sys
import time

from batchserve.llm import LLM
from batchserve.request import SamplingParams

def main(rounds: int = 2) -> None:
    m = LLM(kv_cache_gb=0.25)
    eng = m.engine
    ids = eng.tokenize("The quick brown fox jumps over the lazy dog. " * 120)[:1000]
    assert len(ids) == 1000

    def run(tag: str, group: bool, prefix: bool) -> tuple[float, float, int]:
        eng.kv.prefix_caching = prefix
        start_batches = eng.scheduler.num_steps
        t0 = time.perf_counter()
        for j in range(4):
            eng.add_request(list(ids), SamplingParams(max_tokens=16, temperature=1.0, seed=j, ignore_eos=True),
                            request_id=f"{tag}-{j}", group=tag if group else None)
        first: dict[str, float] = {}
        while eng.has_unfinished:
            for o in eng.step().outputs:
                if o.request_id not in first and o.token_ids:
                    first[o.request_id] = time.perf_counter() - t0
        total = time.perf_counter() - t0
        eng.kv.prefix_caching = False
        return total, max(first.values()), eng.scheduler.num_steps - start_batches

    for rnd in range(rounds):
        for tag, group, prefix in (("alone", False, False), ("alone+prefix-cache", False, True),
                                   ("group", True, False)):
            # a fresh prompt each round for the prefix-cache case: nothing cached from before
            ids[0] = 100 + rnd * 3 + len(tag) % 3
            total, ttft, steps = run(f"{tag}-{rnd}", group, prefix)
            print(f"round {rnd} {tag:20s} e2e {total * 1000:7.0f} ms  last first token {ttft * 1000:7.0f} ms  "
                  f"steps {steps}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
