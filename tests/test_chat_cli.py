"""`batchserve chat`: the loop keeps the conversation, streams each answer, survives a failed
turn; the event parser reads what the server's own writer produces. Model-free."""
from __future__ import annotations

from batchserve.chat import converse, sse_text
from batchserve.core.batch import RequestOutput
from batchserve.request import FinishReason
from batchserve.server.responses import ChunkWriter


def test_the_loop_keeps_history_resets_and_survives_an_error() -> None:
    lines = iter(["hello", "", "fail", "again", "/reset", "fresh", "/exit", "never read"])
    seen: list[list[dict]] = []
    out: list[str] = []

    def stream(messages):
        seen.append(messages)
        if messages[-1]["content"] == "fail":
            raise RuntimeError("HTTP 503: busy")
        yield "ans-"
        yield messages[-1]["content"]

    history = converse(stream, lambda _: next(lines), out.append, system="be brief")
    assert [len(m) for m in seen] == [2, 4, 4, 2]  # the failed turn is not kept; /reset keeps the system
    assert seen[2] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                       {"role": "assistant", "content": "ans-hello"}, {"role": "user", "content": "again"}]
    assert history == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fresh"},
                       {"role": "assistant", "content": "ans-fresh"}]
    assert "error: HTTP 503: busy" in "".join(out) and "(history cleared)" in "".join(out)


def test_end_of_input_leaves_quietly() -> None:
    def read(_):
        raise EOFError

    assert converse(lambda m: iter(()), read, lambda s: None) == []


def test_sse_text_reads_the_servers_own_stream() -> None:
    w = ChunkWriter("chatcmpl-1", 0, "m", True, True)
    outs = [RequestOutput("r", [1], [5], [5], False, new_text="Hel"),
            RequestOutput("r", [1], [5, 6], [6], True, FinishReason.STOP, text="Hello", new_text="lo")]
    body = b"".join(w.write(o) for o in outs).decode()
    assert "".join(sse_text(body.splitlines())) == "Hello"
    err = 'data: {"error": {"message": "deadline missed"}, "status_code": 504}'
    try:
        list(sse_text([err]))
    except RuntimeError as e:
        assert "deadline missed" in str(e)
    else:
        raise AssertionError("an error event must raise")
