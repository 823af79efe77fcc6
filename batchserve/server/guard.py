"""The ASGI layer in front of every route: a request id, the Host check, the access log.

Each HTTP request gets an id before any route runs (a generation route replaces it with its
completion id), answered as `X-Request-Id` and carried into the error bodies of 5xx answers,
so that a client can quote it and the log be searched by it. The Host header must name an
allowed host: a page that rebinds its DNS name to 127.0.0.1 sends its own name, and is refused
(a 400 before any route, key or body is looked at). One access log line per request, to the
`batchserve.access` logger: id, method, path, status, latency.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from batchserve.config import ServerConfig

log = logging.getLogger("batchserve.access")
Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]
_WILDCARD = ("", "0.0.0.0", "::")


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """The host names a Host header may carry (None: any). `allowed_hosts` when set (`*`: any);
    else the bind address, and the loopback names when it is a loopback address; a wildcard bind
    (0.0.0.0, ::) cannot know its names and checks nothing unless told."""
    if config.allowed_hosts is not None:
        names = {h.strip().lower() for h in config.allowed_hosts.split(",") if h.strip()}
        return None if "*" in names else frozenset(names)
    host = config.host.strip("[]").lower()
    if host in _WILDCARD:
        return None
    names = {host}
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    return frozenset(names)


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lowercased."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class Guard:
    """ASGI middleware: request id, Host check, access log (see the module docstring).
    `on_status` is told the status of each refusal it answers itself (for /metrics)."""

    def __init__(self, app: ASGIApp, config: ServerConfig, on_status: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.hosts = allowed_hosts(config)
        self.on_status = on_status

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        state["request_id"] = "req-" + uuid.uuid4().hex
        status = [0]

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", state["request_id"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
                await self._refuse(send_with_id, host)
            else:
                await self.app(scope, receive, send_with_id)
        except BaseException:
            status[0] = status[0] or 500  # answered by the error handler outside
            raise
        finally:
            log.info("%s %s %s %d %.1fms", state["request_id"], scope["method"], scope["path"], status[0],
                     (time.perf_counter() - t0) * 1000)

    async def _refuse(self, send: Callable, host: str) -> None:
        body = json.dumps({"error": {"message": f"Host header {host[:100]!r} is not a name this server answers to "
                                                "(see --allowed-hosts)",
                                     "type": "invalid_request_error", "param": None, "code": "invalid_host"}}).encode()
        if self.on_status is not None:
            self.on_status(400)
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
