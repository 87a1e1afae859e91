"""The proxy path's HTTP/1.1 client: one request per connection at a time, kept-alive
connections pooled per origin, the response parsed by httptools (the parser uvicorn uses).

Why not aiohttp here: a relayed request needs none of a general client's machinery (URL
objects, cookie jars, multidicts, trace hooks, a request object and a response object
per call, a stream reader with its own buffers), and under `kvrelay bench gateway` that
machinery cost about a fifth of the gateway's CPU per streamed request. This client
writes the request head as bytes, hands each body chunk the parser decodes to the one
reader waiting for it, and keeps nothing else per call. aiohttp stays for the gateway's
background calls (health checks, pollers), where its cost does not matter.

Contract, as the relay needs it:
- `send` returns once the response's status line and headers arrived; it raises
  `ConnectFailedError` when no byte of a response came (refused, reset, closed): the
  caller may try another upstream.
- The body is read once, by `read` (all of it) or `readany` (what has arrived; b"" at
  its end); a connection that breaks mid-body raises `BodyBrokenError`.
- `release` keeps the connection for the next request when the body was read to its end
  and the server keeps it alive; otherwise the connection is closed, which is also how
  a client's hang-up cancels the upstream's generation.
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections import deque
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 18  # bytes of unread body before the socket is paused
_DECODABLE = (b"gzip", b"x-gzip", b"deflate")


class HttpClientError(Exception):
    """Base of this module's errors."""


class ConnectFailedError(HttpClientError):
    """No response came: the connection failed, or closed before any byte of an answer."""


class BodyBrokenError(HttpClientError):
    """The response's body ended early or could not be parsed."""


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))

    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection and the response under way on it."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.idle_since = 0.0
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self._headers_seen: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: BaseException | None = None
        self._got_bytes = False
        self._keep_alive = False
        self._framed = False  # content-length or chunked: the body's end is known without EOF
        self._interim = False  # the message being parsed is a 1xx before the answer
        self._decoder: zlib._Decompress | None = None
        self._paused = False

    @property
    def got_bytes(self) -> bool:
        """Some byte of an answer to the request under way came."""
        return self._got_bytes

    @property
    def usable(self) -> bool:
        return not self._closed and self._transport is not None and not self._transport.is_closing()

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:  # a callback's own error rides as the context
            cause = exc.__context__ if isinstance(exc.__context__, HttpClientError) else None
            self._fail(cause or BodyBrokenError(f"malformed HTTP response: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._complete or self._error is not None:
            return
        if self._headers_seen is not None and self._headers_seen.done() and not self._framed:
            self._finish()  # a body delimited by the connection's close has ended
        elif self._headers_seen is not None and not self._headers_seen.done():
            self._fail(ConnectFailedError(f"connection closed before a response ({exc or 'EOF'})"))
        elif self._headers_seen is not None:
            self._fail(BodyBrokenError(f"connection closed mid-body ({exc or 'EOF'})"))

    # -- httptools callbacks -------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True
        elif name == b"content-encoding" and (coding := value.strip().lower()) not in (b"identity", b""):
            if coding not in _DECODABLE:
                raise BodyBrokenError(f"unsupported content-encoding {coding.decode(errors='replace')!r}")
            self._decoder = zlib.decompressobj(zlib.MAX_WBITS | 32 if coding != b"deflate" else zlib.MAX_WBITS)

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._interim = 100 <= status < 200  # "100 Continue" and the like: the answer follows
        if self._interim:
            return
        self.status = status
        self._keep_alive = self._parser.should_keep_alive()
        if self._headers_seen is not None and not self._headers_seen.done():
            self._headers_seen.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._decoder is not None:
            body = self._decoder.decompress(body)
            if not body:
                return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            return
        if self._decoder is not None and (tail := self._decoder.flush()):
            self._chunks.append(tail)
        self._finish()

    # -- the request ------------------------------------------------------------------------
    async def send(self, head: bytes, body: bytes) -> None:
        """Write the request; return once the response's headers arrived."""
        assert self._transport is not None
        self._reset()
        self._headers_seen = asyncio.get_running_loop().create_future()
        self._transport.writelines((head, body))
        await self._headers_seen

    async def readany(self) -> bytes:
        """What has arrived of the body, waiting for some; b"" once it has all been read."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._drain())
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= _HIGH_WATER // 4 and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    @property
    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    @property
    def reusable(self) -> bool:
        return self.at_eof and self._keep_alive and self._error is None and self.usable

    def set_exception(self, exc: BaseException) -> None:
        """Fail the pending (or next) read: how IdleWatch ends a stalled stream."""
        self._fail(exc)

    def abort(self) -> None:
        self._closed = True
        if self._transport is not None:
            self._transport.abort()

    # -- internals --------------------------------------------------------------------------
    def _drain(self) -> list[bytes]:
        chunks = list(self._chunks)
        self._chunks.clear()
        return chunks

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = exc
        if self._headers_seen is not None and not self._headers_seen.done():
            self._headers_seen.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class HttpClient:
    """Kept-alive connections per origin, at most `limit` requests in flight together."""

    def __init__(self, limit: int, keepalive_s: float, connect_s: float, tls: ssl.SSLContext | None = None) -> None:
        self._slots = asyncio.Semaphore(limit)
        self._keepalive_s = keepalive_s
        self._connect_s = connect_s
        self._idle: dict[Origin, list[Connection]] = {}
        self._limit = limit
        self._tls = tls  # for https origins; None: the system's trusted CAs, verified (made on first use)

    async def send(self, origin: Origin, head: bytes, body: bytes) -> Connection:
        """The connection, its response's headers received; `release` it when done.

        A kept-alive connection may be closed by the server just as a request goes out on
        it: its keep-alive ran out (uvicorn's is 5 s, shorter than ours) and the close
        crossed the request, which the server never read. Such a request is sent once
        more, on a new connection, when not a byte of an answer came on the old one (as
        HTTP clients do); anything else is the caller's failure."""
        await self._slots.acquire()
        try:
            if (pooled := self._pooled(origin)) is not None:
                try:
                    return await _sent_on(pooled, head, body)
                except ConnectFailedError:
                    if pooled.got_bytes:
                        raise
            return await _sent_on(await self._connect(origin), head, body)
        except BaseException:
            self._slots.release()
            raise

    def release(self, conn: Connection) -> None:
        """Back to the pool when its response was read to the end; closed otherwise."""
        self._slots.release()
        if not conn.reusable:
            conn.abort()
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self._limit:
            conn.abort()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()

    def _pooled(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_ok = asyncio.get_running_loop().time() - self._keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closed by the server
            if conn.usable and conn.idle_since >= oldest_ok:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        tls = self._context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(self._connect_s):
                transport, conn = await loop.create_connection(lambda: Connection(origin), origin.host, origin.port,
                                                               ssl=tls)
        except TimeoutError as exc:
            raise ConnectFailedError(f"connecting took over {self._connect_s:g}s") from exc
        except OSError as exc:  # refused, unreachable, name not resolved, TLS failures (ssl.SSLError)
            raise ConnectFailedError(f"{type(exc).__name__}: {exc}") from exc
        conn.connection_made(transport)  # uvloop calls it only on the next turn of the loop
        return conn

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


async def _sent_on(conn: Connection, head: bytes, body: bytes) -> Connection:
    """`conn` with the request sent and its answer's headers in; aborted if that fails."""
    try:
        await conn.send(head, body)
    except BaseException:
        conn.abort()
        raise
    return conn


def request_head(method: str, origin: Origin, path: str, headers: dict[str, str], body_length: int) -> bytes:
    """The request line and headers. A header value cannot hold CR or LF (it would end the
    head early and smuggle a request), so such a value is refused."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {origin.host_header()}", f"Content-Length: {body_length}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    try:
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    except UnicodeEncodeError as exc:
        raise ValueError("a header holds a character outside Latin-1") from exc
