"""A fault-injecting HTTP proxy on loopback: forwards S3 requests to a real server, damages some by rule.

The request bytes go upstream unchanged (SigV4 signs the Host header the
client sent, which names the proxy; the server sees exactly what was signed).
Responses are re-framed with a Content-Length, so a body can be damaged,
cut short or stalled on the way back. Which request gets which fault is a
rule table keyed by method and blob key (the last path segment), each rule
hitting the `times` requests it matches after skipping the first `after`
(or every one from there on).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import logging
import socket
import socketserver
import struct
import threading
import urllib.parse
from dataclasses import dataclass
from typing import BinaryIO, Literal

log = logging.getLogger(__name__)

Action = Literal[
    "500",  # an InternalError answer
    "503",  # a ServiceUnavailable answer
    "slowdown",  # 503 with S3's SlowDown error code (throttling)
    "stall",  # read the request, answer nothing for `stall_s`, then close
    "hold",  # read the request, forward it only once `release` is called (a store that hangs)
    "reset",  # read the request, then reset the connection without an answer
    "stall_body",  # headers and half the body, then nothing for `stall_s`
    "reset_body",  # headers and half the body, then reset the connection
    "truncate",  # headers (full Content-Length) and half the body, then close
    "flip",  # the whole answer with one bit of the body flipped
    "short",  # half the body, framed as if that were the whole object (truncated at rest)
    # A server that ignores Range and sends the whole object as a 200 with its
    # SHA-256 (as SeaweedFS does for a GET without Range), which botocore then
    # checks. Only for a range that covered the whole object already (the
    # store's first GET of a blob below its multipart threshold).
    "whole",
    "whole_flip",  # the same, with one bit of the body flipped under that checksum
]

_ERRORS: dict[str, tuple[int, str, str, str]] = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "503": (
        503,
        "Service Unavailable",
        "ServiceUnavailable",
        "Service is unable to handle request.",
    ),
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}
# Headers the proxy sets itself when it re-frames an answer.
_REFRAMED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


@dataclass
class Fault:
    """One rule: `action` on requests with `method` for blob `key` (None: any key)."""

    action: Action
    method: str = "GET"
    key: str | None = None
    times: int | None = 1  # None: every matching request
    after: int = 0  # matching requests let through untouched first
    matched: int = 0
    hits: int = 0


@dataclass(frozen=True)
class Seen:
    """One request the proxy received, and the fault it got (None: forwarded untouched)."""

    method: str
    key: str
    fault: Action | None


class FaultProxy:
    """`url` forwards to `upstream` (http://host:port), injecting the faults added with `inject`."""

    def __init__(self, upstream: str, *, stall_s: float = 3.0) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.stall_s = stall_s
        self._faults: list[Fault] = []
        self._seen: list[Seen] = []
        self._holding = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._released = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def inject(
        self,
        action: Action,
        *,
        key: str | None = None,
        method: str = "GET",
        times: int | None = 1,
        after: int = 0,
    ) -> Fault:
        """Add a rule; the first rule that matches a request and has hits left applies to it."""
        fault = Fault(action, method.upper(), key, times, after)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Drop every rule and forget the requests seen (held requests stay held)."""
        with self._lock:
            self._faults.clear()
            self._seen.clear()

    def release(self) -> None:
        """Forward every request held by a "hold" rule, and any later one, as usual."""
        self._released.set()

    def hold_again(self) -> None:
        """Make "hold" rules hold again after `release`."""
        self._released.clear()

    def held(self) -> int:
        """How many requests are held right now."""
        with self._lock:
            return self._holding

    def seen(self, method: str | None = None, key: str | None = None) -> list[Seen]:
        """The requests received so far (oldest first), optionally only for `method` / `key`."""
        with self._lock:
            return [
                s
                for s in self._seen
                if (method is None or s.method == method.upper()) and (key is None or s.key == key)
            ]

    def close(self) -> None:
        self._closing.set()  # releases stalled handlers, and drops held requests
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decide(self, method: str, key: str) -> Action | None:
        with self._lock:
            action: Action | None = None
            for f in self._faults:
                if f.method != method or (f.key is not None and f.key != key):
                    continue
                f.matched += 1
                if f.matched > f.after and (f.times is None or f.hits < f.times):
                    f.hits += 1
                    action = f.action
                    break
            self._seen.append(Seen(method, key, action))
            return action


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    proxy: FaultProxy

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hung up mid-answer is routine here; anything else is logged.
        log.debug("fault proxy: error serving %s", client_address, exc_info=True)


class _Handler(socketserver.BaseRequestHandler):
    request: socket.socket
    server: _Server

    def handle(self) -> None:
        proxy = self.server.proxy
        reader = self.request.makefile("rb")
        try:
            while not proxy._closing.is_set():
                raw, method, target = _read_request(reader, self.request)
                if raw is None:
                    return
                key = urllib.parse.urlsplit(target).path.rstrip("/").rsplit("/", 1)[-1]
                action = proxy._decide(method, key)
                if not self._answer(proxy, raw, method, action):
                    return
        except (OSError, http.client.HTTPException):
            return
        finally:
            reader.close()

    def _answer(self, proxy: FaultProxy, raw: bytes, method: str, action: Action | None) -> bool:
        """Answer one request; False when the connection is to be dropped."""
        sock = self.request
        if action in _ERRORS:
            status, reason, code, message = _ERRORS[action]
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                "<RequestId>kvc-fault-proxy</RequestId></Error>"
            ).encode()
            head = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nx-amz-request-id: kvc-fault-proxy\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            return True
        if action == "stall":
            proxy._closing.wait(proxy.stall_s)
            return False
        if action == "hold":
            with proxy._lock:
                proxy._holding += 1
            try:
                while not proxy._released.wait(0.05):
                    if proxy._closing.is_set():
                        return False
            finally:
                with proxy._lock:
                    proxy._holding -= 1
        if action == "reset":
            _reset(sock)
            return False
        status, reason, headers, body = _forward(proxy.upstream, raw, method)
        if action in ("whole", "whole_flip") and status == 206:
            digest = base64.b64encode(hashlib.sha256(body).digest()).decode("ascii")
            status, reason = 200, "OK"
            headers = [(k, v) for k, v in headers if k.lower() != "content-range"]
            headers.append(("x-amz-checksum-sha256", digest))
        if action in ("flip", "whole_flip") and body:
            damaged = bytearray(body)
            damaged[len(damaged) // 3] ^= 0x10
            body = bytes(damaged)
        if action == "short" and body:
            body = body[: len(body) // 2]
            headers = [
                (k, f"bytes 0-{len(body) - 1}/{len(body)}")
                if k.lower() == "content-range"
                else (k, v)
                for k, v in headers
            ]
        lines = [f"HTTP/1.1 {status} {reason}"]
        lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _REFRAMED]
        length = next((v for k, v in headers if k.lower() == "content-length"), None)
        if method != "HEAD" and status not in (204, 304):
            length = str(len(body))
        if length is not None:
            lines.append(f"Content-Length: {length}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if action in ("stall_body", "reset_body", "truncate") and len(body) > 1:
            sock.sendall(head + body[: len(body) // 2])
            if action == "stall_body":
                proxy._closing.wait(proxy.stall_s)
            elif action == "reset_body":
                _reset(sock)
            return False
        sock.sendall(head + (body if method != "HEAD" else b""))
        return True


def _read_request(reader: BinaryIO, sock: socket.socket) -> tuple[bytes | None, str, str]:
    """One request's raw bytes (head and body, as sent), its method and its target."""
    first = reader.readline(65537)
    while first in (b"\r\n", b"\n"):
        first = reader.readline(65537)
    if not first:
        return None, "", ""
    method, target, _ = first.decode("latin-1").split(" ", 2)
    head = [first]
    headers: dict[str, str] = {}
    while True:
        line = reader.readline(65537)
        if not line:
            return None, "", ""
        head.append(line)
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("expect", "").lower() == "100-continue":
        # Answer for the server, so the client sends its body now rather than
        # after its own wait; the server's own interim answer is skipped later.
        sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = bytearray()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = reader.readline(65537)
            body += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = reader.readline(65537)
                    body += trailer
                    if trailer in (b"\r\n", b"\n", b""):
                        break
                break
            body += _read_exact(reader, size + 2)
    else:
        body += _read_exact(reader, int(headers.get("content-length", "0")))
    return b"".join(head) + bytes(body), method.upper(), target


def _read_exact(reader: BinaryIO, n: int) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise ConnectionError("client closed the connection mid-request")
    return data


def _forward(
    upstream: tuple[str, int], raw: bytes, method: str
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """Send `raw` upstream on a fresh connection; the whole answer (interim 100s skipped)."""
    with socket.create_connection(upstream, timeout=30) as up:
        up.sendall(raw)
        resp = http.client.HTTPResponse(up, method=method)
        try:
            resp.begin()
            body = resp.read()
            return resp.status, resp.reason, resp.getheaders(), body
        finally:
            resp.close()


def _reset(sock: socket.socket) -> None:
    # Linger 0 makes close() send RST instead of FIN: the peer sees "connection reset".
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
