"""A flaky network on loopback: an HTTP proxy that injects faults between a client and a server.

    with FaultyProxy("http://127.0.0.1:8090", plan=["drop", "flip", "zero_length", "stall"]) as proxy:
        download(repo, folder, endpoint=proxy.endpoint)

Each entry of ``plan`` applies, in order, to the next request it fits; requests it does not fit pass
untouched, and an entry that finds nothing to spoil (a body shorter than its cut) waits for the next. Three
families:

- on a file body (GET ``.../resolve/...``):
  ``drop``      the head and part of the body, then the connection is cut
  ``stall``     the head and part of the body, then silence until the client gives up
  ``flip``      the whole body with one byte changed: complete, the right length, wrong
  ``truncate``  a shorter ``Content-Length`` and that many bytes: complete by HTTP, too short
- on a file's metadata (HEAD ``.../resolve/...``):
  ``zero_length``   ``Content-Length: 0``: a client that trusts it writes an empty file and is done
  ``wrong_length``  a ``Content-Length`` 1000 bytes too large
- on any request:
  ``error`` (503), ``server_error`` (500), ``rate_limit`` (429 with Retry-After), ``html`` (200 with a
  captive portal's HTML page instead of the answer), ``reset`` (the connection closed before any answer)

``injected`` counts the faults actually applied; ``requests`` records every request's method, path and
header names (what a client sent, e.g. whether an ``authorization`` header travelled).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import Counter, defaultdict
from urllib.parse import urlsplit

from .download import require_endpoint
from .errors import require_choice, require_number, require_whole_number
from .mirror import LOOPBACK, ServerThread, Service, free_port, parse_request_head, require_port

BODY_FAULTS = ("drop", "stall", "flip", "truncate")
HEAD_FAULTS = ("zero_length", "wrong_length")
ANY_REQUEST_FAULTS = ("error", "server_error", "rate_limit", "html", "reset")
KINDS = BODY_FAULTS + HEAD_FAULTS + ANY_REQUEST_FAULTS
# faults a client can take for a finished download: the whole body arrived, only its bytes are wrong
SILENT_FAULTS = ("flip", "zero_length")
STATUS_LINES = {"error": b"HTTP/1.1 503 Service Unavailable", "server_error": b"HTTP/1.1 500 Internal Server Error",
                "rate_limit": b"HTTP/1.1 429 Too Many Requests"}
CAPTIVE_PORTAL = b"<!DOCTYPE html><html><body><h1>Welcome to the hotel Wi-Fi</h1><p>Please log in.</p></body></html>"


class FaultyProxy(Service):
    def __init__(self, upstream: str, plan=(), *, port: int | None = None, drop_after_bytes: int = 64 * 1024,
                 stall_s: float = 3.0):
        for kind in plan:
            require_choice(kind, KINDS, "fault")
        parts = urlsplit(require_endpoint(upstream, "upstream"))
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.plan = list(plan)
        self.drop_after_bytes = require_whole_number(drop_after_bytes, "drop_after_bytes", minimum=0, unit="bytes")
        self.stall_s = require_number(stall_s, "stall_s")
        self.port = free_port() if port is None else require_port(port)
        self.injected: Counter = Counter()
        self.requests: list = []  # (method, path, header names in lower case)
        self.body_bytes: dict = defaultdict(int)       # path -> body bytes sent to the client
        self.complete_transfers: Counter = Counter()  # path -> whole, unspoiled bodies delivered
        self.sizes: dict = {}  # path -> Content-Length its HEAD announced
        self._lock = threading.Lock()
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def faults_left(self) -> int:
        return len(self.plan)

    def _next_fault(self, method: str, path: str):
        """The next planned fault, if this request can carry it; the plan is kept in order, so a shuffled
        plan mixes the kinds as a bad network does."""
        with self._lock:
            if not self.plan:
                return None
            kind, is_file = self.plan[0], "/resolve/" in path
            fits = (kind in ANY_REQUEST_FAULTS or (kind in BODY_FAULTS and method == "GET" and is_file)
                    or (kind in HEAD_FAULTS and method == "HEAD" and is_file))
            return self.plan.pop(0) if fits else None

    def _unspend(self, fault: str) -> None:
        """A fault that found nothing to spoil (a body shorter than its cut) waits for the next request."""
        with self._lock:
            self.plan.insert(0, fault)

    async def _answer_without_upstream(self, writer, fault: str) -> None:
        if fault == "reset":
            _reset(writer)
            return
        if fault == "html":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % len(CAPTIVE_PORTAL) + CAPTIVE_PORTAL)
        else:
            retry_after = b"Retry-After: 1\r\n" if fault == "rate_limit" else b""
            writer.write(STATUS_LINES[fault] + b"\r\nContent-Length: 0\r\n" + retry_after + b"Connection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path, headers = parse_request_head(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            writer.close()
            return
        self.requests.append((method, path, {name.lower() for name, _ in headers}))
        fault = self._next_fault(method, path)
        if fault in ANY_REQUEST_FAULTS:
            self.injected[fault] += 1
            await self._answer_without_upstream(writer, fault)
            return
        lines = [line for line in head.decode("latin-1").split("\r\n") if line and not line.lower().startswith("connection:")]
        forwarded = ("\r\n".join(lines) + "\r\nConnection: close\r\n\r\n").encode("latin-1")
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        applied = False
        try:
            up_writer.write(forwarded)
            await up_writer.drain()
            response_head = await up_reader.readuntil(b"\r\n\r\n")
            length, chunked = _header(response_head, b"content-length"), _header(response_head, b"transfer-encoding") == b"chunked"
            if method == "HEAD" and length is not None:
                self.sizes[path] = int(length)  # the GET that follows is chunked: its length is known from here
            body_length = self.sizes.get(path) if chunked else int(length) if length is not None else None
            if chunked:  # forwarded decoded, with its length where the HEAD told it (else ended by the close)
                response_head = _without(response_head, b"transfer-encoding")
                if body_length is not None:
                    response_head = _without(response_head, b"content-length", add=body_length)
            if fault in HEAD_FAULTS and length is not None:
                response_head = _without(response_head, b"content-length", add=0 if fault == "zero_length" else int(length) + 1000)
                applied = True
            cut = None
            if fault in ("drop", "stall", "truncate"):
                cut = max(1, min(self.drop_after_bytes, body_length // 2)) if body_length else self.drop_after_bytes
                if fault == "truncate" and body_length is not None:
                    response_head = _without(response_head, b"content-length", add=cut)
            writer.write(response_head)
            sent, body = 0, _Body(up_reader, chunked)
            while chunk := await body.read():
                if fault == "flip" and not applied:
                    spoiled = bytearray(chunk)
                    spoiled[len(spoiled) // 2] ^= 0x20
                    chunk, applied = bytes(spoiled), True
                if cut is not None and sent + len(chunk) >= cut:
                    writer.write(chunk[: cut - sent])
                    sent, applied = cut, True
                    await writer.drain()
                    if fault == "stall":
                        await asyncio.sleep(self.stall_s)
                    if fault == "truncate":
                        writer.close()  # a clean end: by HTTP the answer is complete, only short
                    else:
                        _reset(writer)
                    break
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()
            self.body_bytes[path] += sent
            if method == "GET" and response_head.split(b" ")[1].startswith(b"2") and not applied:
                self.complete_transfers[path] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if fault is not None:
                if applied:
                    self.injected[fault] += 1
                else:
                    self._unspend(fault)
            up_writer.close()
            if not writer.is_closing():
                writer.close()

    def start(self) -> FaultyProxy:
        self._server = ServerThread(self._handle, socket.create_server((LOOPBACK, self.port)), f"faulty-proxy-{self.port}").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()


def _reset(writer) -> None:
    """Cut the connection with a TCP reset, as a dropped link does, not with an orderly close."""
    connection = writer.get_extra_info("socket")
    if connection is not None:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().lower()
    return None


def _without(head: bytes, name: bytes, add: int | None = None) -> bytes:
    """The head without header ``name``; with ``add``, that header set to ``add`` instead."""
    lines = [line for line in head.split(b"\r\n") if line and not line.lower().startswith(name + b":")]
    if add is not None:
        lines.insert(1, name.title() + b": %d" % add)
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Body:
    """A response body read as it arrives: decoded from chunked transfer coding, else up to the close."""

    def __init__(self, reader, chunked: bool):
        self.reader, self.chunked, self.left, self.done = reader, chunked, 0, False

    async def read(self, block: int = 65536) -> bytes:
        if not self.chunked:
            return await self.reader.read(block)
        if self.done:
            return b""
        if self.left == 0:
            self.left = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if self.left == 0:
                self.done = True
                return b""
        piece = await self.reader.readexactly(min(block, self.left))
        self.left -= len(piece)
        if self.left == 0:
            await self.reader.readexactly(2)  # the CRLF after each chunk
        return piece
