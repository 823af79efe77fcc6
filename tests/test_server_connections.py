"""Slow, silent and oversized clients against a real uvicorn server (the bounded protocol of
server/connections.py) around a model-free engine: the server stays reachable. Small limits,
so that each case takes a second or less; 127.0.0.1 only."""
from __future__ import annotations

import socket
import time

import httpx
import pytest
from fake_server import fake_engine
from server_helpers import MODEL, start_server

from batchserve.config import ServerConfig

pytestmark = pytest.mark.http

LIMITS = ServerConfig(max_connections=8, header_timeout_s=0.5, keep_alive_s=0.5, max_header_bytes=4096,
                      max_headers=20)


@pytest.fixture(scope="module")
def server():
    srv = start_server(fake_engine(check_leaks=False), LIMITS)
    yield srv
    srv.stop()


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=3)
    return s


def read_all(s: socket.socket, timeout: float = 3.0) -> bytes:
    """Everything until the server closes (or `timeout`)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/1.1 ") else 0


def reachable(server) -> None:
    assert httpx.get(server.url + "/health", timeout=3).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2}, timeout=5)
    assert r.status_code == 200, r.text


def test_silent_clients_are_cut_off_and_extra_connections_get_503(server) -> None:
    silent = [connect(server) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    t0 = time.monotonic()
    extra = connect(server)
    resp = read_all(extra)
    assert status(resp) == 503 and b"Retry-After" in resp and b'"error"' in resp
    assert time.monotonic() - t0 < 0.4  # at once, not after the header timeout
    for s in silent:  # each gets a 408 and is closed within the header timeout
        assert status(read_all(s)) == 408
    assert time.monotonic() - t0 < 2.0
    reachable(server)


def test_a_slow_client_is_cut_off_at_the_header_timeout(server) -> None:
    s = connect(server)
    t0 = time.monotonic()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    got = b""
    s.settimeout(0.1)
    while time.monotonic() - t0 < 3:
        try:
            s.sendall(b"X")  # one byte of a header that never ends
            got += s.recv(65536)
            if got:
                break
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    assert status(got) == 408 and time.monotonic() - t0 < 1.5
    reachable(server)


@pytest.mark.parametrize("headers", [
    b"X-Big: " + b"a" * 8000 + b"\r\n",  # one header too large
    b"".join(b"X-%d: 1\r\n" % i for i in range(21)),  # too many
    b"".join(b"X-%d: 1\r\n" % i for i in range(20_000)),  # far too many
])
def test_oversized_headers_get_431(server, headers) -> None:
    s = connect(server)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert status(read_all(s)) == 431
    reachable(server)


def test_an_endless_header_line_is_refused_after_a_few_kilobytes(server) -> None:
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Huge: ")
    sent, chunk = 0, b"a" * 65536
    try:
        while sent < 100 << 20:  # would be 100 MB
            s.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        pass
    assert sent < 8 << 20, f"the server took {sent} bytes of one header line"
    reachable(server)


def test_idle_keep_alive_connections_are_closed(server) -> None:
    with httpx.Client(base_url=server.url, timeout=3) as c:
        assert c.get("/health").status_code == 200
        s = connect(server)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        t0 = time.monotonic()
        resp = read_all(s)
        assert status(resp) == 200 and 0.3 < time.monotonic() - t0 < 2.0  # closed after keep_alive_s
