"""uvicorn with the connection limits it lacks, so that slow or silent clients cannot make the
server unreachable for the others.

uvicorn's httptools protocol keeps a connection that never finishes its headers forever, and
takes headers of any size and number. `BoundedHttpToolsProtocol` is that protocol with:

- a cap on open connections: one beyond `max_connections` is answered 503 (Retry-After) and
  closed at once, so it holds no file descriptor (the cap is lowered to fit the process's
  open-file limit, or the accept loop would fail first);
- a header-read timeout: a connection that has not sent complete request headers within
  `header_timeout_s` of connecting (or of starting its next request) gets 408 and is closed;
- limits on request headers: more than `max_header_bytes` (request line included) or more than
  `max_headers` lines get 431 and the connection is closed, before a route sees anything;
- idle keep-alive connections closed after `keep_alive_s` (uvicorn's own timer).

Everything else is uvicorn's: this subclass only counts and refuses. `uvicorn_config` builds the
uvicorn.Config that `batchserve serve` (and the tests) run.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchserve.config import ServerConfig

log = logging.getLogger(__name__)
_FD_RESERVE = 64  # descriptors kept for everything but client connections (model files, pipes, logs)
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to fit the soft open-file limit less a reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - _FD_RESERVE))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap, a header timeout and header limits
    (see the module docstring). The limits are class attributes: `protocol_class` makes a
    subclass per configuration."""

    max_connections = 512
    header_timeout_s = 10.0
    max_header_bytes = 32768
    max_headers = 100

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused = False
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too many open connections; retry later", {"Retry-After": "1"})
            return
        self._begin_headers()

    def _begin_headers(self) -> None:
        self._in_headers, self._raw, self._bytes, self._count = True, 0, 0, 0
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _end_headers(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            self._refuse(408, f"request headers not received within {self.header_timeout_s:g} s")

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        """Answer `status` with an OpenAI-shaped JSON error and close the connection."""
        self._refused = True
        self._end_headers()
        if self.transport.is_closing():
            return
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                     "overloaded_error", "param": None, "code": f"http_{status}"}}).encode()
        head = [f"HTTP/1.1 {status} {_REASONS[status]}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self.transport.close()
        log.info("connection from %s refused: %d %s", self.client, status, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_headers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._in_headers and not self._refused:
            self._raw += len(data)  # headers not complete yet: all of it is request line and headers
            if self._raw > self.max_header_bytes:
                self._refuse(431, f"request headers exceed {self.max_header_bytes} bytes")

    # parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begin_headers()

    def on_url(self, url: bytes) -> None:
        self._bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._bytes += len(name) + len(value) + 4
        self._count += 1
        if self._count > self.max_headers:
            self._refuse(431, f"more than {self.max_headers} request headers")
        elif self._bytes > self.max_header_bytes:
            self._refuse(431, f"request headers exceed {self.max_header_bytes} bytes")
        else:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._end_headers()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()


def protocol_class(config: ServerConfig) -> type[BoundedHttpToolsProtocol]:
    """The protocol with `config`'s limits (the connection cap fitted to the fd limit)."""
    cap = connection_cap(config.max_connections)
    if cap < config.max_connections:
        log.warning("max_connections lowered from %d to %d to fit the open-file limit", config.max_connections, cap)
    return type("BoundedHttp", (BoundedHttpToolsProtocol,), {
        "max_connections": cap, "header_timeout_s": config.header_timeout_s,
        "max_header_bytes": config.max_header_bytes, "max_headers": config.max_headers})


def uvicorn_config(app: Any, config: ServerConfig, **kw: Any) -> uvicorn.Config:
    """The uvicorn.Config that serves `app` under `config`'s connection limits; `kw` are
    further uvicorn settings (log level, graceful-shutdown timeout)."""
    return uvicorn.Config(app, host=config.host, port=config.port, http=protocol_class(config),
                          timeout_keep_alive=config.keep_alive_s, access_log=False, **kw)
