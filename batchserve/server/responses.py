"""The OpenAI response side: JSON bodies, SSE chunks, and what each finish reason means on
the wire (`FAILURES`: the one table from finish reasons to HTTP errors; `WIRE_REASONS`: the
answered reasons outside OpenAI's set, and the OpenAI one reported in their place)."""
from __future__ import annotations

import json
import math
from typing import Any, Callable

from batchserve.core.batch import RequestOutput, TokenLogprob
from batchserve.request import FinishReason
from batchserve.server.protocol import APIError
from batchserve.server.tools import ToolCalling, tool_message

SSE_DONE = b"data: [DONE]\n\n"
_R = FinishReason
# Finish reasons that are not a normal answer: (HTTP status, what happened, code, type, retry?).
# Every other reason (stop, length, deadline_truncated) is a 200. A missed hard deadline will be
# missed again: x-should-retry tells the OpenAI SDKs not to resend it (they retry 5xx by default).
FAILURES: dict[FinishReason, tuple[int, str, str, str, bool]] = {
    _R.DEADLINE: (504, "the request's deadline was missed", "deadline_exceeded", "timeout_error", False),
    _R.REJECTED: (503, "the request was dropped from a full queue", "dropped", "overloaded_error", True),
    _R.ABORT: (503, "the request was aborted (server shutting down)", "aborted", "overloaded_error", True),
    _R.ERROR: (500, "generation failed", "model_error", "server_error", False),
}


# Clients switch on OpenAI's finish reasons (stop, length, ...): an answer cut short for a soft
# deadline is "length" to them, and the real reason rides beside it as batchserve_finish_reason.
WIRE_REASONS: dict[FinishReason, str] = {_R.TRUNCATED: "length"}
EXTRA_REASON = "batchserve_finish_reason"


def finish_fields(reason: FinishReason | None, native: bool = False) -> dict[str, Any]:
    """A choice's finish_reason, and batchserve_finish_reason where the OpenAI-set value stands
    in for ours; with `native`, our reason itself and nothing beside it."""
    wire = None if native or reason is None else WIRE_REASONS.get(reason)
    if wire is None:
        return {"finish_reason": reason}
    return {"finish_reason": wire, EXTRA_REASON: str(reason)}


def retry_after(seconds: float) -> dict[str, str]:
    """A Retry-After header: whole seconds, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def output_error(out: RequestOutput, retry_after_s: float = 1.0) -> APIError | None:
    """The error a finished output stands for, or None if it is a normal answer."""
    failure = FAILURES.get(out.finish_reason)  # type: ignore[arg-type]
    if failure is None:
        return None
    status, what, code, kind, retry = failure
    detail = f": {out.error}" if out.error else ""  # the engine's own words, never exception text
    if status >= 500:  # what the server log can be searched by
        detail += f" (request id {out.request_id})"
    headers = retry_after(retry_after_s) if retry else {"x-should-retry": "false"}
    return APIError(status, what + detail, code=code, type=kind, headers=headers)


def usage(out: RequestOutput | list[RequestOutput], n: int = 1) -> dict[str, int]:
    """Token counts of one output, or of a request's choices (n per prompt: each prompt
    counted once)."""
    outs = out if isinstance(out, list) else [out]
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def cumulative_logprob(out: RequestOutput) -> float:
    """The sum of the logprobs of an output's sampled tokens (0 for one that reports none)."""
    return math.fsum(e.logprob for e in out.logprobs or ())


def best_candidates(outs: list[RequestOutput], candidates: int, n: int) -> list[int]:
    """best_of: of each prompt's `candidates` consecutive outputs, the indices of the `n` with
    the highest cumulative logprob of their sampled tokens, best first (a tie: the earlier
    candidate), prompt by prompt (OpenAI's and vLLM's ranking)."""
    picked: list[int] = []
    for start in range(0, len(outs), candidates):
        group = range(start, min(start + candidates, len(outs)))
        picked += sorted(group, key=lambda i: (-cumulative_logprob(outs[i]), i))[:n]
    return picked


TokenText = Callable[[int], str]


def _chat_entry(tid: int, lp: float, text: TokenText) -> dict[str, Any]:
    t = text(tid)
    return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}


def logprobs_body(entries: list[TokenLogprob] | None, chat: bool, text: TokenText,
                  offset: int = 0) -> dict[str, Any] | None:
    """A choice's `logprobs` for these tokens, in the endpoint's own shape (None when the
    request asked for none). Chat: {"content": [{token, logprob, bytes, top_logprobs}]};
    completions: {tokens, token_logprobs, top_logprobs, text_offset}, offsets counted from
    `offset` (the text before these tokens)."""
    if entries is None:
        return None
    if chat:
        return {"content": [{**_chat_entry(e.token_id, e.logprob, text),
                             "top_logprobs": [_chat_entry(i, v, text) for i, v in e.top]} for e in entries],
                "refusal": None}
    tokens = [text(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): v for i, v in e.top} for e in entries], "text_offset": offsets}


def _echo_logprobs(out: RequestOutput, text: TokenText) -> dict[str, Any]:
    """Completions' logprobs over the prompt and the answer (echo with logprobs): the first
    prompt token has none, as in OpenAI's and vLLM's answers."""
    prompt = [None, *out.prompt_logprobs[1:]]
    tokens = [text(t) for t in out.prompt_token_ids] + [text(e.token_id) for e in out.logprobs]
    entries = prompt + list(out.logprobs)
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {text(i): v for i, v in e.top} for e in entries],
            "text_offset": offsets}


def _vllm_prompt_logprobs(out: RequestOutput, text: TokenText) -> list | None:
    """vLLM's choice.prompt_logprobs: per prompt position, None (the first) or {token id: {logprob,
    decoded_token}} for the prompt's token and the most likely ones."""
    return [None if e is None else {str(i): {"logprob": v, "decoded_token": text(i)}
                                    for i, v in ((e.token_id, e.logprob), *e.top)} for e in out.prompt_logprobs]


def completion_body(rid: str, created: int, model: str, out: RequestOutput | list[RequestOutput], chat: bool,
                    native_finish: bool = False, token_text: TokenText = str, n: int = 1,
                    prefixes: list[str] | None = None, tool_calling: ToolCalling | None = None,
                    usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """The non-streaming response for a finished output, or a request's finished choices in
    order (n per prompt); `native_finish`: see finish_fields; `token_text`: a token's text, for
    logprobs; `prefixes`: text before each choice's (echo); `tool_calling`: the answers are
    tool calls; `usage_`: the usage to report, when more was generated than is answered
    (best_of: every candidate's tokens count), else that of the choices."""
    outs = out if isinstance(out, list) else [out]
    choices = []
    for i, o in enumerate(outs):
        finish = finish_fields(o.finish_reason, native_finish)
        lp = logprobs_body(o.logprobs, chat, token_text)
        if chat:
            message = {"role": "assistant", "content": o.text}
            if tool_calling is not None:
                message, finish["finish_reason"] = tool_message(tool_calling, o.text, finish["finish_reason"])
            choices.append({"index": i, "message": message, "logprobs": lp, **finish})
        else:
            text = (prefixes[i] if prefixes else "") + o.text
            if prefixes and lp is not None and o.prompt_logprobs is not None:
                lp = _echo_logprobs(o, token_text)
            choices.append({"index": i, "text": text, "logprobs": lp, **finish})
        if o.prompt_logprobs is not None:
            choices[-1]["prompt_logprobs"] = _vllm_prompt_logprobs(o, token_text)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(outs, n) if usage_ is None else usage_}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class ChunkWriter:
    """Turns a request's outputs into SSE bytes: one write per output read. With several
    choices, one writer per choice (`index`), each with `last` False: the caller writes the
    usage and the end (`end`) once all are done. `prefix`: text before the choice's (echo)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                 native_finish: bool = False, token_text: TokenText = str, index: int = 0, last: bool = True,
                 prefix: str = "", tool_calling: ToolCalling | None = None) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.include_usage, self.native_finish, self.token_text = include_usage, native_finish, token_text
        self.index, self.last, self._prefix = index, last, prefix
        self.tool_calling = tool_calling  # the answer is tool calls: sent whole, once complete
        self._started = False
        self._offset = 0  # completions' text_offset: characters of the tokens reported so far
        # A text delta is most of a stream's chunks, and only its text changes: the bytes around
        # it are built once (the same bytes sse() would write for the whole object; the text is
        # the object's last string).
        self._delta_head, self._delta_tail = self._chunk(self._choice("\x00", None)).rsplit(b'"\\u0000"', 1)

    def _delta(self, text: str) -> bytes:
        """`self._chunk(self._choice(text, None))` without building and encoding the object."""
        return self._delta_head + json.dumps(text, ensure_ascii=False).encode() + self._delta_tail

    def _chunk(self, choice: dict[str, Any] | None, usage_: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model,
                               "choices": [choice] if choice is not None else []}
        if self.include_usage:
            obj["usage"] = usage_
        return sse(obj)

    def _choice(self, text: str | None, finish: FinishReason | None, lps: list | None = None) -> dict[str, Any]:
        reason = finish_fields(finish, self.native_finish)
        lp = None
        if lps:
            lp = logprobs_body(lps, self.chat, self.token_text, self._offset)
            if not self.chat:
                self._offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if self.chat:
            delta = {} if text is None else {"content": text}
            return {"index": self.index, "delta": delta, "logprobs": lp, **reason}
        return {"index": self.index, "text": text or "", "logprobs": lp, **reason}

    def _prose(self, out: RequestOutput) -> bool:
        """Whether a tool_choice "auto" answer has turned out to be prose (its grammar lets a
        call, and only a call, start with "<"): then it streams as text, not held for the end."""
        return self.tool_calling is not None and self.tool_calling.auto and out.text[:1] not in ("", "<")

    def _text(self, out: RequestOutput) -> bytes:
        """The chunk with this output's new text (and its tokens' logprobs), or nothing."""
        if self.tool_calling is not None and not self._prose(out):
            return b""  # the calls go out whole at the end (write)
        if out.new_logprobs:
            return self._chunk(self._choice(out.new_text, None, out.new_logprobs))
        return self._delta(out.new_text) if out.new_text else b""

    def write(self, out: RequestOutput) -> bytes:
        """Chunks for one (possibly merged) output; the last ones once it is finished."""
        parts: list[bytes] = []
        if self.chat and not self._started:
            parts.append(self._chunk({"index": self.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
        if self._prefix and not self._started:
            parts.append(self._delta(self._prefix))
        self._started = True
        if not out.finished:
            parts.append(self._text(out))
            return b"".join(parts)
        err = output_error(out)
        if err is not None:  # the status line is long gone: an error event, as OpenAI streams do
            parts.append(self._text(out))
            parts.append(sse({**err.body(), "status_code": err.status}))
            return b"".join(parts) + SSE_DONE  # (the end of the whole stream, whatever `last`)
        if self.chat and self.tool_calling is not None and not self._prose(out):
            message, reason = tool_message(self.tool_calling, out.text, finish_fields(out.finish_reason)["finish_reason"])
            delta = ({"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]}
                     if "tool_calls" in message else {"content": message["content"]})
            lp = logprobs_body(out.logprobs, True, self.token_text)
            parts.append(self._chunk({"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": None}))
            parts.append(self._chunk({**self._choice(None, out.finish_reason), "finish_reason": reason}))
        elif self.chat:
            parts.append(self._text(out))
            parts.append(self._chunk(self._choice(None, out.finish_reason)))
        else:
            parts.append(self._chunk(self._choice(out.new_text, out.finish_reason, out.new_logprobs)))
        if not self.last:
            return b"".join(parts)
        return b"".join(parts) + self.end(usage(out))

    def end(self, usage_: dict[str, int]) -> bytes:
        """The stream's last bytes: the usage chunk (when asked for) and [DONE]."""
        return (self._chunk(None, usage_) if self.include_usage else b"") + SSE_DONE
