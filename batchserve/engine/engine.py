"""LLMEngine: queue + KV bookkeeping + scheduler + executor, one `step()` at a time."""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from batchserve.config import EngineConfig
from batchserve.core.batch import RequestOutput, RunningOutput, ScheduledBatch, StepOutput, StepRecord, TokenLogprob
from batchserve.core.kv_cache import KVCacheManager
from batchserve.core.latency import load_latency_profile
from batchserve.core.policies import make_policy
from batchserve.core.scheduler import Scheduler
from batchserve.core.stats import EngineSnapshot, QueueMetrics, QueueStats
from batchserve.engine.clock import WallClock
from batchserve.engine.detokenizer import DetokState, detokenize_step, find_stop, text_decoder
from batchserve.request import DEFAULT_PRIORITY, Constraint, Request, RequestError, RequestSpec, RequestStatus, SamplingParams

_RUNNING = RequestStatus.RUNNING

log = logging.getLogger(__name__)


class Executor(Protocol):
    num_blocks: int
    max_model_len: int

    def execute(self, batch: ScheduledBatch) -> StepOutput: ...


@dataclass
class EngineStep:
    """What one `LLMEngine.step` did: the outputs for callers, and what the model ran (None
    when the step ran nothing, e.g. while a batching window is open)."""

    outputs: list[RequestOutput]
    ran: StepRecord | None = None


class StepFailed(RuntimeError):
    """A model step failed; `request_ids` are the requests its batch held (the scheduler
    still has them: the caller decides their fate, see `LLMEngine.fail`)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


def _template_messages(messages: list[dict], template: Any) -> list[dict]:
    """Messages for a chat template: one that knows nothing of tool calls gets each earlier
    assistant call as its text (the JSON it was made of), so that turn is not lost."""
    if isinstance(template, str) and "tool_calls" in template:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            m = {"role": m["role"], "content": (m.get("content") or "") + json.dumps(calls, ensure_ascii=False)}
        elif "tool_call_id" in m:
            m = {"role": m["role"], "content": m["content"]}
        out.append(m)
    return out


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"  # the tagged call form (server/tools.py)


def tools_text(tools: list[dict]) -> str:
    """The system text that tells a model whose chat template does not render tools what it may
    call and in which form (the form a tool_choice of "auto" holds its answer to)."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    return (f"You may call these functions: {listed}\nTo call one, answer with nothing but "
            f'{TOOL_OPEN}{{"name": <function name>, "arguments": <its arguments as JSON>}}{TOOL_CLOSE}')


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` at the end of their system message (a new one first if none)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tokenize(tokenizer: Any | None, prompt: str | list[int] | None = None,
             messages: list[dict] | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, describe_tools: bool = False,
             template_options: dict[str, Any] | None = None) -> list[int]:
    """A prompt (text or token ids) or chat messages (through the chat template, with `tools`
    if given, opening the assistant's turn unless not `add_generation_prompt`) as token ids.
    `template_options`: add_generation_prompt, continue_final_message and template variables,
    as vLLM's request fields give them (they win over `add_generation_prompt`).
    `describe_tools`: a template that does not render tools gets them in a system message (the
    model is to choose whether to call one, so it must see them).
    Whatever the tokenizer or the template raises on an input is that input's fault: a
    RequestError naming the field (a 400), not an exception out of the server."""
    if messages is not None:
        if tokenizer is None:
            raise RequestError("messages", "this model has no tokenizer / chat template")
        try:
            template = getattr(tokenizer, "chat_template", None)
            msgs = _template_messages(messages, template)
            if tools and describe_tools and not (isinstance(template, str) and "tools" in template):
                msgs = _with_system(msgs, tools_text(tools))
            extra: dict[str, Any] = {"tools": tools} if tools else {}
            opts = dict(template_options or {})
            add_generation_prompt = opts.pop("add_generation_prompt", add_generation_prompt)
            out = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                **extra, **opts)
        except Exception as e:  # noqa: BLE001 - e.g. a template that refuses this order of roles
            raise RequestError("messages", f"cannot be put through the chat template ({type(e).__name__})") from None
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    if isinstance(prompt, list):
        return prompt
    if not isinstance(prompt, str):
        raise RequestError("prompt", "must be a string or a list of token ids")
    if tokenizer is None:
        raise RequestError("prompt", "this model has no tokenizer; pass token ids")
    try:
        return tokenizer.encode(prompt, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - e.g. text that is not valid Unicode
        raise RequestError("prompt", f"cannot be tokenized ({type(e).__name__})") from None


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Any | None = None,
                 eos_token_id: int | None = None, clock: Any | None = None) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer) if tokenizer is not None else None
        self.eos_token_id = eos_token_id
        self.clock = clock or WallClock()
        self.kv = KVCacheManager(executor.num_blocks, config.cache.block_size, config.cache.prefix_caching)
        profile = config.scheduler.latency_profile  # step times measured by `batchserve profile`
        latency = load_latency_profile(profile) if profile else None
        self.scheduler = Scheduler(config.scheduler, self.kv,
                                   make_policy(config.scheduler.policy, config.scheduler, latency=latency),
                                   config.queue, latency=latency)
        self._detok: dict[str, DetokState] = {}
        self._held: dict[str, tuple[int, str]] = {}  # finished, not yet released: (n_new, text)
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_failed_steps = 0  # steps the executor raised on (then bisected)
        self.num_isolated_requests = 0  # requests ended because the executor failed on them alone
        self._compiler = None  # structured outputs: compiles constraints, made on first use
        self._grammars: dict[str, Any] = {}  # request id -> its Grammar, while it runs
        self._in_flight: ScheduledBatch | None = None  # the running step's batch (interject)
        self._interjected = 0.0  # virtual time: seconds of steps interjected into the running one

    @classmethod
    def from_config(cls, config: EngineConfig, clock: Any | None = None) -> "LLMEngine":
        """Load the model named by config.model and build the engine around a real runner."""
        from batchserve.runner.loader import load_model, release_freed_memory
        from batchserve.runner.model_runner import ModelRunner

        if config.scheduler.cascade_workers:  # prefill and decode stages in two processes
            from batchserve.runner.cascade_workers import CascadeWorkersExecutor

            ex = CascadeWorkersExecutor(config)
            return cls(config, ex, ex.tokenizer, ex.cfg.eos_token_id, clock)
        loaded = load_model(config.model)
        runner = ModelRunner(loaded, config.model, config.cache)
        log.info("model %s loaded: %d layers, %.1fM params; KV pool holds %d tokens",
                 loaded.name, loaded.config.num_layers, loaded.config.num_params() / 1e6,
                 runner.num_blocks * config.cache.block_size)
        cfg, tok = loaded.config, loaded.tokenizer
        del loaded  # the float32 copies the runner did not keep (all of them with GGUF blocks)
        release_freed_memory()
        engine = cls(config, runner, tok, cfg.eos_token_id, clock)
        engine.warm_up()
        return engine

    # --- intake -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                 tools: list[dict] | None = None, describe_tools: bool = False,
                 template_options: dict[str, Any] | None = None) -> list[int]:
        return tokenize(self.tokenizer, prompt, messages, tools=tools, describe_tools=describe_tools,
                        template_options=template_options)

    def prepare(self, spec: RequestSpec) -> RequestSpec:
        """Tokenize a request and check it against the model and the cache: the spec with its
        prompt as token ids and the max_tokens it will run with. Raises RequestError naming
        the field to blame (the prompt when it alone does not fit, else max_tokens). It reads
        only what does not change while the engine runs (tokenizer, context length, cache
        size), so any thread may call it: a server does it off the engine thread."""
        where = "messages" if spec.messages is not None else "prompt"
        ids = self.tokenize(spec.prompt, spec.messages, spec.tools, spec.describe_tools, spec.template_options)
        if not ids:
            raise RequestError(where, "must not be empty")
        params = spec.params
        if spec.auto_max_tokens is not None:  # no limit given: what the context leaves
            room = min(self.executor.max_model_len, self.kv.num_blocks * self.kv.block_size) - len(ids)
            params = dataclasses.replace(params, max_tokens=max(1, min(spec.auto_max_tokens, room)))
        self._check(ids, params.max_tokens, where, params.logit_bias)
        grammar = self.compile(spec.constraint) if spec.constraint is not None else None
        return dataclasses.replace(spec, prompt=ids, messages=None, tools=None, params=params, auto_max_tokens=None,
                                   grammar=grammar)

    def compile(self, constraint: Constraint):
        """The Grammar for a structured-output constraint (engine/structured.py); RequestError
        naming the constraint's field if it does not compile. Any thread may call it."""
        if self._compiler is None:
            from batchserve.engine.structured import Compiler

            cfg = getattr(self.executor, "cfg", None)
            vocab = getattr(cfg, "vocab_size", None) or len(getattr(self.tokenizer, "get_vocab", dict)())
            self._compiler = Compiler(self.tokenizer, vocab, self.eos_token_id)
        return self._compiler.compile(constraint)

    def add(self, spec: RequestSpec, now: float | None = None, prepared: bool = False) -> Request:
        """Tokenize and queue a request (`prepared`: `prepare` has already been done). Raises
        RequestError naming the bad field, or OverloadedError (HTTP 503) when its queue level is
        full and refuses new requests. `now` (else `spec.arrival_time`, else the clock) is its
        arrival. A request that cannot make its hard deadline, or one dropped from a full level
        for this one, ends in the next step's outputs (finish reason "deadline" / "rejected")."""
        if not prepared:
            spec = self.prepare(spec)
        at = spec.arrival_time if now is None else now
        req = self._new_request(spec.prompt, spec.params, at, spec.request_id, spec.priority, spec.deadline_ms,
                                spec.deadline_kind)
        req.tenant, req.group = spec.tenant, spec.group
        if spec.constraint is not None:  # a prepared spec carries its grammar; one grammar per request
            req.grammar = spec.grammar if prepared and spec.grammar is not None else self.compile(spec.constraint)
            req.extras = True
            self._grammars[req.request_id] = req.grammar
        self.scheduler.add(req, req.arrival_time)
        if self.tokenizer is not None:
            self._detok[req.request_id] = DetokState()
        return req

    def add_request(self, prompt: str | list[int] | None, params: SamplingParams, now: float | None = None,
                    request_id: str | None = None, priority: int = DEFAULT_PRIORITY, deadline_ms: float | None = None,
                    deadline_kind: str | None = None, messages: list[dict] | None = None,
                    tenant: str | None = None, group: str | None = None) -> Request:
        """`add` with the spec's fields as arguments (offline use, tests, simulators)."""
        return self.add(RequestSpec(params, prompt, messages, request_id, priority, deadline_ms, deadline_kind,
                                    tenant=tenant, group=group), now)

    def add_prefilled(self, prompt_ids: list[int], first_token: int, kv: Any, params: SamplingParams,
                      now: float | None = None, request_id: str | None = None, priority: int = DEFAULT_PRIORITY,
                      deadline_ms: float | None = None, deadline_kind: str | None = None,
                      arrival: float | None = None, first_token_time: float | None = None,
                      constraint: Constraint | None = None, first_logprob: Any = None) -> Request:
        """Take over a request another engine prefilled (disaggregated serving): `kv` holds its
        prompt's K/V (as `ModelRunner.export_kv` gives it), `first_token` the token sampled
        there, whose text that engine already sent. The request joins the running batch at
        once; if its blocks don't fit now, it queues and recomputes its prompt instead.
        `arrival` / `first_token_time` (this engine's clock) default to `now`, the hand-off.
        `constraint`: its structured-output constraint, compiled here and advanced past
        `first_token`; `first_logprob`: that token's TokenLogprob (for a request that asked for
        logprobs; without it, that one has no alternatives and logprob 0)."""
        if kv is None or kv.shape[2] != len(prompt_ids):
            raise ValueError(f"KV hand-off: K/V for {None if kv is None else kv.shape[2]} positions, "
                             f"prompt has {len(prompt_ids)}")
        at = self.clock.now() if now is None else now
        self._check(prompt_ids, params.max_tokens, bias=params.logit_bias)
        req = self._new_request(prompt_ids, params, at if arrival is None else arrival, request_id, priority,
                                deadline_ms, deadline_kind)
        req.output_token_ids.append(first_token)
        req.last_token_time = at if first_token_time is None else first_token_time
        if req.output_logprobs is not None:
            req.output_logprobs.append(first_logprob or TokenLogprob(first_token, 0.0))
        req.first_token_time = at if first_token_time is None else first_token_time
        if constraint is not None:
            req.grammar = self.compile(constraint)
            req.extras = True
            if not req.grammar.accept(first_token):
                raise RequestError(constraint.field, "the prefilled first token does not fit the constraint")
            self._grammars[req.request_id] = req.grammar
        if self.scheduler.adopt(req, len(prompt_ids), at):
            try:
                self.executor.import_kv(self.kv.block_table(req.request_id), kv)
            except Exception:
                self.scheduler.hand_off(req.request_id, at)  # back to the caller, with the exception
                raise
            self.kv.commit(req)
        else:
            self.scheduler.add(req, at)
        if self.tokenizer is not None:
            st = self._detok[req.request_id] = DetokState()
            detokenize_step(self._decode, req.output_token_ids, st)  # its text went out from the prefill side
        return req

    def _check(self, ids: list[int], max_tokens: int, where: str = "prompt", bias: tuple = ()) -> None:
        """RequestError unless the token ids (the prompt's, and those of `bias`, a logit_bias)
        are the model's and prompt plus max_tokens fit both the context and the cache; `where`
        names the prompt's field."""
        vocab = getattr(getattr(self.executor, "cfg", None), "vocab_size", None)
        if vocab is not None and any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError("prompt", f"token ids must be integers in [0, {vocab})")
        if vocab is not None and any(t >= vocab for t, _ in bias):
            raise RequestError("logit_bias", f"token ids must be in [0, {vocab})")
        limit, n = self.executor.max_model_len, len(ids)
        if n >= limit:
            raise RequestError(where, f"is {n} tokens; the model's context holds {limit}, with room for at "
                               "least one token to generate")
        if n + max_tokens > limit:
            raise RequestError("max_tokens", f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the "
                               f"model's context of {limit} tokens")
        if self.kv.blocks_for(n + 1) > self.kv.num_blocks:
            raise RequestError(where, f"is {n} tokens; the KV cache holds {self.kv.num_blocks * self.kv.block_size}")
        need = self.kv.blocks_for(n + max_tokens)
        if need > self.kv.num_blocks:
            raise RequestError("max_tokens", f"prompt plus max_tokens needs {need} KV blocks; "
                               f"the cache holds {self.kv.num_blocks}")

    def _new_request(self, ids: list[int], params: SamplingParams, now: float | None, request_id: str | None,
                     priority: int, deadline_ms: float | None, deadline_kind: str | None) -> Request:
        rid = request_id or f"req-{next(self._ids)}"
        return Request(rid, ids, params, self.clock.now() if now is None else now, priority=priority,
                       deadline_ms=deadline_ms, deadline_kind=deadline_kind, eos_token_id=self.eos_token_id)

    def warm_up(self, rounds: int = 2) -> None:
        """Run a few synthetic requests before serving. Each round but the last runs one short
        request (a prompt step, then decodes), which pays the one-time costs of the first steps
        and is forgotten. The last runs five short prompts, each joining the batch a step after
        the last, once the queue is empty (so no cap is in the way), until all are done, the last
        one alone: ten steps of mixed shapes (prompts with decodes, decodes of one to four
        sequences), which seed the latency model, so the first real request with a hard deadline
        is judged on measured step times (refused at once when it cannot make it) instead of
        admitted blind. As few steps as that takes, since the server is not ready until they
        are done. Nothing of it stays: no request, block or counter."""
        sched = self.scheduler
        vocab = getattr(getattr(self.executor, "cfg", None), "vocab_size", None) or 1000
        for r in range(rounds):
            last = r == rounds - 1
            if last and hasattr(sched.latency, "clear"):
                sched.latency.clear()  # a profiled model keeps its fit; it does not learn online
                sched.deadlines.forget_steps()
            shapes = [(32, 4)] * 4 + [(8, 6)] if last else [(32, 3)]  # (prompt tokens, output tokens)
            for i, (n_prompt, n_out) in enumerate(shapes):
                while len(sched.waiting):  # a seat cap of one, or a queue cap of one: wait for it
                    self.step()
                ids = [(7 * r + 13 * i + k) % (vocab - 1) + 1 for k in range(n_prompt)]
                self.add_request(ids, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True),
                                 request_id=f"warm-up-{r}-{i}")
                self.step()
            while self.has_unfinished:
                self.step()
        sched.waiting.metrics = QueueMetrics(sched.waiting.levels)
        sched.num_steps = sched.num_preemptions = 0
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.num_generated_tokens = 0

    def abort(self, request_id: str, now: float | None = None) -> None:
        self.scheduler.abort(request_id, self.clock.now() if now is None else now)

    def hand_off(self, request_id: str, now: float | None = None) -> None:
        """The request leaves this engine to carry on elsewhere (disaggregated serving): its
        blocks are freed and it has no further output here."""
        self.scheduler.hand_off(request_id, self.clock.now() if now is None else now)
        self._detok.pop(request_id, None)
        self._grammars.pop(request_id, None)

    def fail(self, request_ids: list[str], error: str, now: float | None = None) -> None:
        """End these requests with finish reason "error" and `error` (a failed step); their
        outputs come out of the next step. `error` is what callers are told, so it holds no
        exception text (that goes to the log, with the request ids)."""
        self.scheduler.fail(request_ids, error, self.clock.now() if now is None else now)

    def snapshot(self) -> EngineSnapshot:
        """The gauges of engine state, read between steps."""
        sched, kv, policy = self.scheduler, self.kv, self.scheduler.policy
        return EngineSnapshot(
            waiting=sched.waiting.lengths_by_level(), running=len(sched.running), kv_usage=kv.usage,
            kv_free_blocks=kv.num_free_blocks, kv_blocks=kv.num_blocks, preemptions=sched.num_preemptions,
            interjections=sched.num_interjections,
            prefix_hit_rate=kv.prefix_hit_rate, prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            window_ms=policy.window_ms, max_batch=policy.max_batch,
            queue=sched.waiting.stats(self.clock.now()))

    def queue_stats(self, now: float | None = None) -> QueueStats:
        """Admission-queue metrics: per-level lengths, waits, rejections, drops,
        promotions, deadline misses; field names in core/stats.py."""
        return self.scheduler.waiting.stats(self.clock.now() if now is None else now)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._held)

    def next_step_due(self, now: float) -> float | None:
        """After a step that ran nothing at `now`: when the next one could run something if
        no request arrives (the policy's answer, e.g. a batching window closing), or None
        when the policy cannot tell and the caller should poll. The simulator jumps there."""
        return self.scheduler.policy.next_step_due(self.scheduler, now)

    # --- the loop -----------------------------------------------------------------------
    def step(self, now: float | None = None) -> EngineStep:
        """schedule -> execute -> update. With `now` given, time is virtual: the step ends at
        now + the executor's step_time; otherwise both ends are read from the clock.

        A batch the executor fails on is not failed whole: `_execute_isolating` finds the
        requests it fails on and ends only those (finish reason "error"), so one poison request
        never ends another's stream. Raises StepFailed, naming the batch's requests, when the
        step fails outside the executor (the scheduler's update, detokenizing). The executor may
        run a step for another request between two of this one's layers (`interject`); virtual
        time then counts both."""
        start = self.clock.now() if now is None else now
        batch = self.scheduler.schedule(start)
        if batch.empty:
            return EngineStep(self._outputs([], start))
        self._in_flight, self._interjected = batch, 0.0
        try:
            return self._run(batch, start, now)
        finally:
            self._in_flight = None

    def interject(self, now: float | None = None) -> EngineStep | None:
        """From inside a running step (the executor's `between_layers`): run to its end the step
        the scheduler has for now (Scheduler.interjection), before the paused one goes on. None
        when it has none. The paused step's requests are untouched: it ends as it would have,
        later by this step's time. With `now` given, time is virtual as in step()."""
        if self._in_flight is None:
            return None
        start = self.clock.now() if now is None else now
        batch = self.scheduler.interjection(start, {s.request_id for s in self._in_flight.seqs})
        if batch.empty:
            return None
        paused, self._interjected = self._interjected, 0.0
        try:
            step = self._run(batch, start, now)
        finally:
            self._interjected = paused
        if now is not None and step.ran is not None:
            self._interjected += step.ran.step_time
        return step

    def _run(self, batch: ScheduledBatch, start: float, now: float | None) -> EngineStep:
        """execute -> update for a scheduled batch (step() and interject())."""
        if self._grammars:  # structured outputs: the tokens each constrained row may sample
            grammars = self._grammars
            for seq in batch.seqs:
                g = grammars.get(seq.request_id)
                if g is not None:
                    seq.allowed = g.mask() if seq.sample else None
        output, culprits = self._execute_isolating(batch)
        try:
            end = self.clock.now() if now is None else start + output.step_time + self._interjected
            if culprits:
                self.fail(list(culprits), "the model step failed on this request alone (the server log has the "
                          "cause; the other requests of the step carried on)", end)
                batch = ScheduledBatch([s for s in batch.seqs if s.request_id not in culprits],
                                       batch.num_padding_tokens)
            changed = self.scheduler.update(batch, output, end)
            self.num_generated_tokens += len(output.sampled)
            outs = self._outputs(changed, end)
        except Exception as e:
            raise StepFailed([s.request_id for s in batch.seqs], e) from e
        if batch.empty:  # its one request failed
            return EngineStep(outs)
        return EngineStep(outs, StepRecord(batch.num_seqs, batch.num_tokens, len(output.sampled), output.step_time,
                                           self.scheduler.token_gaps))

    def _execute_isolating(self, batch: ScheduledBatch) -> tuple[StepOutput, dict[str, BaseException]]:
        """Run the batch. If the executor raises, bisect: run each half on its own, split a
        failing half again, down to the single requests it fails on (the culprits). Returns
        the merged output of every part that ran and the culprits with their errors; if every
        part runs on its own, there are none and the step goes on as if it had not failed.

        Rerunning a part is safe: nothing the scheduler keeps changes before update(), and a
        step writes only the K/V of its own positions, the same values when run again. A
        request the executor always fails on costs about 2*log2(batch) extra executions."""
        try:
            return self.executor.execute(batch), {}
        except Exception as e:  # noqa: BLE001 - isolated below
            error = e
        self.num_failed_steps += 1
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        scores: dict = {}
        culprits: dict[str, BaseException] = {}
        spent = [0.0]

        def bisect(seqs: list, err: BaseException) -> None:
            if len(seqs) == 1:
                rid = seqs[0].request_id
                culprits[rid] = err
                log.error("model step failed on request %s (%s: %s); the rest of its batch carries on",
                          rid, type(err).__name__, err, exc_info=err)
                return
            mid = len(seqs) // 2
            for part in (seqs[:mid], seqs[mid:]):
                try:
                    out = self.executor.execute(ScheduledBatch(part))
                except Exception as e:  # noqa: BLE001 - split again
                    bisect(part, e)
                else:
                    sampled.update(out.sampled)
                    logprobs.update(out.logprobs or {})
                    scores.update(out.prompt_logprobs or {})
                    spent[0] += out.step_time

        bisect(list(batch.seqs), error)
        if not culprits:
            log.warning("a model step failed (%s: %s) but each part of it ran on its own", type(error).__name__, error)
        self.num_isolated_requests += len(culprits)
        return StepOutput(sampled, spent[0], logprobs or None, scores or None), culprits

    def _outputs(self, changed: list[Request], end: float) -> list[RequestOutput]:
        """The step's outputs: one per running request that got a token, then the finished
        ones the policy releases."""
        detok = self._detok
        # A running request's output (_output(r, 1, ...), hot: every running request, every step).
        # Requests in `changed` are running or just finished (update ends requests; nothing here
        # preempts); the finished ones get their final output below, with the token of this step.
        if detok:
            new_text = {req.request_id: self._detokenize(req, end) for req in changed}
            outs: list[RequestOutput] = []
            for r in changed:
                if r.status is _RUNNING:
                    st = detok.get(r.request_id)
                    outs.append(RunningOutput(r, len(r.output_token_ids), st.text if st is not None else "",
                                              new_text.get(r.request_id, "")))
        else:  # without a tokenizer there is no text, and nothing to detokenize
            new_text = {}
            outs = [RunningOutput(r, len(r.output_token_ids), "", "") for r in changed if r.status is _RUNNING]
        ended_with_token = ({r.request_id for r in changed if r.status is not _RUNNING}
                            if len(outs) < len(changed) else ())
        finished = self.scheduler.drain_finished()  # after detokenizing: a stop string ends a request
        for req in finished:  # final text now, while this step's token is known
            text = new_text.get(req.request_id, "") + self._flush_text(req)
            self._held[req.request_id] = (1 if req.request_id in ended_with_token else 0, text)
        if self._grammars:
            for req in finished:
                self._grammars.pop(req.request_id, None)
        for req in self.scheduler.release(finished, end):  # the policy may hold some back
            n_new, text = self._held.pop(req.request_id)
            outs.append(self._output(req, n_new, text))
            self._detok.pop(req.request_id, None)
        return outs

    def _detokenize(self, req: Request, now: float) -> str:
        """Release the text of the newest token; end the request on a stop string."""
        st = self._detok.get(req.request_id)
        if st is None:
            return ""
        new = detokenize_step(self._decode, req.output_token_ids, st)
        p = req.params  # no stop string ends the answer before min_tokens
        cut = find_stop(st.text, len(new), p.stop) if len(req.output_token_ids) > p.min_tokens else -1
        if cut >= 0:
            new = new[:max(0, len(new) - (len(st.text) - cut))]
            st.text = st.text[:cut]
            st.read_offset = -1  # text is final
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, now)
        return new

    def _flush_text(self, req: Request) -> str:
        """At finish, release whatever the incremental window held back."""
        st = self._detok.get(req.request_id)
        if st is None or st.read_offset < 0 or not req.output_token_ids:
            return ""
        full = self._decode(req.output_token_ids)
        rest = full[len(st.text):] if full.startswith(st.text) else ""
        st.text += rest
        return rest

    def _output(self, req: Request, n_new: int, new_text: str) -> RequestOutput:
        st = self._detok.get(req.request_id)
        done = req.finished
        # While a request runs, token_ids is its live list (copying it every step would cost
        # O(length) per token); once finished, a copy that no longer changes.
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids) if done else req.output_token_ids,
            new_token_ids=req.output_token_ids[-n_new:] if n_new else [], finished=done,
            finish_reason=req.status.finish_reason,
            text=st.text if st is not None else "", new_text=new_text, error=req.error,
            arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=req.finish_time, priority=req.priority, num_preemptions=req.num_preemptions,
            logprobs=None if (lp := req.output_logprobs) is None else (list(lp) if done else lp),
            new_logprobs=None if lp is None else (lp[-n_new:] if n_new else []),
            prompt_logprobs=list(req.prompt_logprobs) if done and req.prompt_logprobs is not None else None,
            level=req.level, tenant=req.tenant)
