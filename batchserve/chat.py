"""`batchserve chat`: a conversation in the terminal with a running server (any OpenAI-compatible
one), its answers streamed as they come. The history is kept and resent each turn, as the API
is stateless; `/reset` starts over, `/exit` (or end of input) leaves.

The loop (`converse`) takes its input, its output and the call that streams one answer as
arguments, so it runs the same against a server, a test's stand-in, or a pipe.
"""
from __future__ import annotations

import json
from typing import Callable, Iterable, Iterator

import httpx

Stream = Callable[[list[dict]], Iterable[str]]


def sse_text(lines: Iterable[str]) -> Iterator[str]:
    """The content deltas of a chat completion's server-sent events; an error event raises."""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"].get("message", "the server reported an error"))
        for choice in event.get("choices", ()):
            text = choice.get("delta", {}).get("content")
            if text:
                yield text


def server_stream(url: str, model: str | None, api_key: str | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, timeout_s: float = 600.0) -> tuple[Stream, str]:
    """(a Stream against the server at `url`, e.g. http://127.0.0.1:8000, the model it serves).
    `model` None: the server's first."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url.rstrip("/").removesuffix("/v1"), headers=headers, timeout=timeout_s)
    if model is None:
        r = client.get("/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    extra = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}

    def stream(messages: list[dict]) -> Iterator[str]:
        body = {"model": model, "messages": messages, "stream": True, **extra}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                try:
                    message = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = r.text
                raise RuntimeError(f"HTTP {r.status_code}: {message}")
            yield from sse_text(r.iter_lines())

    return stream, model


def converse(stream: Stream, read: Callable[[str], str], write: Callable[[str], None],
             system: str | None = None) -> list[dict]:
    """Read a line, stream the answer, repeat until /exit or end of input; the history at the end.
    A failed turn is reported and left out of the history."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return history
        text = line.strip()
        if text in ("/exit", "/quit"):
            return history
        if text == "/reset":
            history = list(start)
            write("(history cleared)\n")
            continue
        if not text:
            continue
        turn = history + [{"role": "user", "content": line}]
        answer: list[str] = []
        try:
            for piece in stream(turn):
                answer.append(piece)
                write(piece)
        except (RuntimeError, httpx.HTTPError) as e:
            write(f"\nerror: {e}\n")
            continue
        except KeyboardInterrupt:  # stop this answer, keep what came
            write(" [interrupted]")
        write("\n")
        history = turn + [{"role": "assistant", "content": "".join(answer)}]
