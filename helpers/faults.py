"""A flaky network on loopback: an HTTP proxy that injects faults between a client and a server.

    with FaultyProxy("http://127.0.0.1:8090", plan=["drop", "error", "stall"]) as proxy:
        download(repo, folder, endpoint=proxy.endpoint)

Each entry of ``plan`` applies to the next request that carries a file body (GET
``.../resolve/...``); ``error`` entries may also hit API requests. Kinds:

- ``drop``:  send the response head and part of the body, then cut the connection
- ``error``: answer ``503 Service Unavailable`` without asking the server
- ``stall``: send the head and part of the body, then go silent until the client gives up
- ``reset``: close the connection before answering
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, defaultdict
from urllib.parse import urlsplit

from .mirror import free_port

KINDS = ("drop", "error", "stall", "reset")


class FaultyProxy:
    def __init__(self, upstream: str, plan=(), *, port: int | None = None, drop_after_bytes: int = 64 * 1024,
                 stall_s: float = 3.0):
        unknown = set(plan) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; use {KINDS}")
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.plan = list(plan)
        self.drop_after_bytes, self.stall_s = drop_after_bytes, stall_s
        self.port = port or free_port()
        self.injected: Counter = Counter()
        self.body_bytes: dict = defaultdict(int)       # path -> body bytes sent to the client
        self.complete_transfers: Counter = Counter()  # path -> whole bodies delivered
        self._lock = threading.Lock()
        self._loop = None
        self._thread = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def faults_left(self) -> int:
        return len(self.plan)

    def _next_fault(self, method: str, path: str):
        with self._lock:
            if not self.plan:
                return None
            carries_body = method == "GET" and "/resolve/" in path
            if self.plan[0] == "error" or carries_body:
                return self.plan.pop(0)
        return None

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        method, path = request_line.split(" ")[:2]
        fault = self._next_fault(method, path)
        if fault:
            self.injected[fault] += 1
        if fault == "reset":
            writer.transport.abort()
            return
        if fault == "error":
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        lines = [line for line in head.decode("latin-1").split("\r\n") if line and not line.lower().startswith("connection:")]
        forwarded = ("\r\n".join(lines) + "\r\nConnection: close\r\n\r\n").encode("latin-1")
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        up_writer.write(forwarded)
        await up_writer.drain()
        try:
            response_head = await up_reader.readuntil(b"\r\n\r\n")
            writer.write(response_head)
            sent, limit = 0, self.drop_after_bytes if fault in ("drop", "stall") else None
            while True:
                chunk = await up_reader.read(65536)
                if not chunk:
                    break
                if limit is not None and sent + len(chunk) >= limit:
                    writer.write(chunk[: max(limit - sent, 1)])
                    sent += max(limit - sent, 1)
                    await writer.drain()
                    if fault == "stall":
                        await asyncio.sleep(self.stall_s)
                    writer.transport.abort()
                    self.body_bytes[path] += sent
                    return
                writer.write(chunk)
                sent += len(chunk)
                await writer.drain()
            self.body_bytes[path] += sent
            if method == "GET" and response_head.split(b" ")[1].startswith(b"2"):
                self.complete_transfers[path] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            up_writer.close()
            if not writer.is_closing():
                writer.close()

    def start(self) -> FaultyProxy:
        ready = threading.Event()

        def serve():
            self._loop = asyncio.new_event_loop()
            server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
            ready.set()
            self._loop.run_forever()
            server.close()
            self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
