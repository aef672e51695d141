"""A small asyncio HTTP/1.1 server that answers like uvicorn does for sglang.

Keep-alive with uvicorn's 5 s idle timeout (http_server.py:1972 timeout_keep_alive=5), chunked streaming
responses, `server: uvicorn` and `date` headers, uvicorn's access-log line, and cancellation of the handler
when the client goes away (sglang then aborts the request). One event loop holds thousands of idle
connections cheaply, which two cores running threads could not.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import socket
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
KEEP_ALIVE_SECONDS = 5.0


@dataclass
class HttpRequest:
    method: str
    target: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    client: tuple[str, int]


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str | None = "application/json"


@dataclass
class StreamResponse:
    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream; charset=utf-8"
    on_close: list[Callable[[], None]] = field(default_factory=list)


Handler = Callable[[HttpRequest], Awaitable["Response | StreamResponse"]]


class Router:
    def __init__(self, auth: Callable[[HttpRequest], Response | None] | None = None) -> None:
        self.routes: dict[str, dict[str, Handler]] = {}
        self.auth = auth  # the API-key middleware: a refusal, or None to go on

    def add(self, methods: tuple[str, ...], path: str, handler: Handler) -> None:
        for method in methods:
            self.routes.setdefault(path, {})[method] = handler

    async def dispatch(self, request: HttpRequest) -> Response | StreamResponse:
        refused = self.auth(request) if self.auth is not None else None  # a middleware: before the routes
        if refused is not None:
            return refused
        by_method = self.routes.get(request.path)
        if by_method is None:
            return Response(404, b'{"detail":"Not Found"}')
        handler = by_method.get(request.method)
        if handler is None:
            return Response(405, b'{"detail":"Method Not Allowed"}')
        return await handler(request)


class _BadRequest(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status


class Connection(asyncio.Protocol):
    def __init__(self, router: Router, access_log: logging.Logger):
        self.router = router
        self.access_log = access_log
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task | None = None
        self.closed = False
        self.client = ("", 0)
        self._writable = asyncio.Event()
        self._writable.set()
        self._idle: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername") or ("", 0)
        self.client = (str(peer[0]), int(peer[1]))
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > MAX_HEADER_BYTES + MAX_BODY_BYTES:
            self._fail(413, "Request Entity Too Large")
            return
        if self.task is None:
            self._next_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()
        if self._idle is not None:
            self._idle.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ------------------------------------------------------------------ requests
    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(KEEP_ALIVE_SECONDS, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self.task is None and self.transport is not None:
            self.transport.close()

    def _next_request(self) -> None:
        try:
            parsed = self._parse()
        except _BadRequest as err:
            self._fail(err.status, str(err))
            return
        if parsed is None:
            return
        if self._idle is not None:
            self._idle.cancel()
        self.task = asyncio.get_running_loop().create_task(self._serve(parsed))

    def _parse(self) -> tuple[HttpRequest, bool] | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEADER_BYTES:
                raise _BadRequest(431, "Request Header Fields Too Large")
            return None
        head = bytes(self.buffer[:end]).decode("latin-1")
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "Invalid HTTP request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _BadRequest(400, "Invalid HTTP header")
            headers[name.strip().lower()] = value.strip()
        body_start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoded = self._dechunk(body_start)
            if decoded is None:
                return None
            body, consumed = decoded
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest(400, "Invalid Content-Length") from None
            if length < 0:
                raise _BadRequest(400, "Invalid Content-Length")
            if length > MAX_BODY_BYTES:
                raise _BadRequest(413, "Request Entity Too Large")
            if len(self.buffer) < body_start + length:
                return None
            body, consumed = bytes(self.buffer[body_start:body_start + length]), body_start + length
        del self.buffer[:consumed]
        split = urlsplit(target)
        keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        return HttpRequest(method, target, split.path or "/", split.query, headers, body, self.client), keep_alive

    def _dechunk(self, start: int) -> tuple[bytes, int] | None:
        body = bytearray()
        pos = start
        while True:
            line_end = self.buffer.find(b"\r\n", pos)
            if line_end < 0:
                return None
            try:
                size = int(bytes(self.buffer[pos:line_end]).split(b";")[0], 16)
            except ValueError:
                raise _BadRequest(400, "Invalid chunk size") from None
            if size == 0:
                trailer_end = self.buffer.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    return None
                return bytes(body), trailer_end + 4
            if len(self.buffer) < line_end + 2 + size + 2:
                return None
            body += self.buffer[line_end + 2:line_end + 2 + size]
            if len(body) > MAX_BODY_BYTES:
                raise _BadRequest(413, "Request Entity Too Large")
            pos = line_end + 2 + size + 2

    def _fail(self, status: int, detail: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            body = f'{{"detail":"{detail}"}}'.encode()
            self.transport.write(_head(status, "application/json", len(body), keep_alive=False) + body)
            self.transport.close()
        self.buffer.clear()

    async def _serve(self, parsed: tuple[HttpRequest, bool]) -> None:
        request, keep_alive = parsed
        try:
            try:
                response = await self.router.dispatch(request)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a handler bug must not take the server down
                logging.getLogger("sglang.srt.entrypoints.http_server").exception("Exception in ASGI application")
                response = Response(500, b"Internal Server Error", "text/plain; charset=utf-8")
                del err
            self._log_access(request, response.status)
            if isinstance(response, StreamResponse):
                await self._stream(response, keep_alive)
            else:
                self._write(_head(response.status, response.content_type, len(response.body), keep_alive)
                            + response.body)
        except asyncio.CancelledError:
            return
        finally:
            self.task = None
        if not keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        if not self.closed:
            self._arm_idle()
            if self.buffer:
                self._next_request()

    async def _stream(self, response: StreamResponse, keep_alive: bool) -> None:
        try:
            self._write(_head(response.status, response.content_type, None, keep_alive))
            async for chunk in response.chunks:
                if self.closed:
                    break
                if chunk:
                    self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await self._writable.wait()
            if not self.closed:
                self._write(b"0\r\n\r\n")
        finally:
            for callback in response.on_close:
                callback()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed and not self.transport.is_closing():
            self.transport.write(data)

    def _log_access(self, request: HttpRequest, status: int) -> None:
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        self.access_log.info('%s:%d - "%s %s HTTP/1.1" %d %s', request.client[0], request.client[1],
                             request.method, request.target, status, phrase)


def _head(status: int, content_type: str | None, length: int | None, keep_alive: bool) -> bytes:
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    lines = [f"HTTP/1.1 {status} {phrase}", f"date: {email.utils.formatdate(usegmt=True)}", "server: uvicorn"]
    if length is None:
        lines.append("transfer-encoding: chunked")
    else:
        lines.append(f"content-length: {length}")
    if content_type:
        lines.append(f"content-type: {content_type}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def bind_socket(host: str, port: int) -> socket.socket:
    """uvicorn's Config.bind_socket: SO_REUSEADDR, then bind; OSError propagates."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve(sock: socket.socket, router: Router, access_log: logging.Logger) -> asyncio.AbstractServer:
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Connection(router, access_log), sock=sock, backlog=2048)


async def request_once(host: str, port: int, method: str, path: str, body: Any) -> int:
    """One HTTP/1.1 request with `connection: close`; the status code (the warm-up's own client)."""
    payload = json.dumps(body).encode() if body is not None else b""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\nuser-agent: python-requests/2.32.5\r\n"
                f"content-type: application/json\r\ncontent-length: {len(payload)}\r\nconnection: close\r\n\r\n")
        writer.write(head.encode() + payload)
        await writer.drain()
        response = await reader.read()
        return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0
    finally:
        writer.close()
