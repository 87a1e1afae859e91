"""kvrelay.gateway.http1: the proxy path's HTTP/1.1 client against scripted servers (raw
sockets, so every framing and failure is the one written here): bodies framed by length,
by chunks and by the connection's close; kept-alive connections reused, and never one the
server closed or a response left half read; each failure as the error its caller maps."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from kvrelay.gateway.http1 import BodyBrokenError, ConnectFailedError, HttpClient, Origin, request_head

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """A server that runs `handler` for each connection and counts the connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: what some tests do on purpose
        finally:
            writer.close()

    @property
    def origin(self) -> Origin:
        assert self.server is not None
        return Origin("http", "127.0.0.1", self.server.sockets[0].getsockname()[1])


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Scripted]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Scripted:
        scripted = Scripted(handler)
        scripted.server = await asyncio.start_server(scripted._serve, "127.0.0.1", 0)
        servers.append(scripted.server)
        return scripted

    yield start
    for server in servers:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def answering(response: bytes, *, then_close: bool = False) -> Handler:
    """A handler that answers one request with `response`, then closes or waits for the client to."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(response)
        await writer.drain()
        if not then_close:
            await reader.read()

    return handler


async def post(client: HttpClient, origin: Origin, body: bytes = b"{}", path: str = "/v1/x") -> tuple[int, bytes]:
    conn = await client.send(origin, request_head("POST", origin, path, {"content-type": "application/json"},
                                                  len(body)), body)
    try:
        return conn.status, await conn.read()
    finally:
        client.release(conn)


async def test_a_length_framed_answer_is_read_and_its_connection_reused(serve) -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            seen.append((head, body))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    assert await post(client, server.origin, b'{"a":1}') == (200, b'{"a":1}')
    assert await post(client, server.origin, b'{"b":2}', "/base/v1/y") == (200, b'{"b":2}')
    assert server.connections == 1
    head = seen[1][0].decode()
    assert head.startswith("POST /base/v1/y HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.origin.port}" in head and "content-type: application/json" in head
    client.close()


async def test_a_chunked_stream_arrives_piece_by_piece(serve) -> None:
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"5\r\nfirst\r\n")
        await writer.drain()
        await go.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    conn = await client.send(server.origin, request_head("POST", server.origin, "/", {}, 0), b"")
    assert conn.status == 200
    assert await conn.readany() == b"first"
    go.set()
    assert await conn.readany() == b"second"
    assert await conn.readany() == b""
    assert conn.at_eof and conn.reusable
    client.release(conn)
    client.close()


async def test_an_interim_answer_is_skipped_for_the_one_that_follows(serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the interim answer is read alone
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone")
        await writer.drain()
        await reader.read()

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    assert await post(client, server.origin) == (201, b"done")
    client.close()


async def test_a_body_that_ends_with_the_connection_is_whole(serve) -> None:
    server = await serve(answering(b"HTTP/1.0 200 OK\r\n\r\nall of it", then_close=True))
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    assert await post(client, server.origin) == (200, b"all of it")
    assert await post(client, server.origin) == (200, b"all of it")
    assert server.connections == 2  # not kept alive: the server closed it
    client.close()


async def test_a_gzip_body_is_decoded_and_an_unknown_coding_refused(serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            if body == b"gzip":
                packed = gzip.compress(b"hello " * 100)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + chunked(packed[:10], packed[10:]))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\nxx")
            await writer.drain()

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    assert await post(client, server.origin, b"gzip") == (200, b"hello " * 100)
    with pytest.raises(BodyBrokenError, match="content-encoding 'br'"):
        await post(client, server.origin, b"br")
    client.close()


async def test_no_server_and_a_close_before_any_answer_fail_to_connect(serve) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    server = await serve(hang_up)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    with pytest.raises(ConnectFailedError, match="closed before a response"):
        await post(client, server.origin)
    port = server.origin.port
    assert server.server is not None
    server.server.close()
    await server.server.wait_closed()
    with pytest.raises(ConnectFailedError):
        await post(client, Origin("http", "127.0.0.1", port))
    client.close()


async def test_a_stream_cut_mid_body_or_malformed_is_broken(serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        if body == b"cut":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot hex\r\n")
        await writer.drain()

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    with pytest.raises(BodyBrokenError, match="mid-body"):
        await post(client, server.origin, b"cut")
    with pytest.raises(BodyBrokenError, match="malformed"):
        await post(client, server.origin, b"bad")
    client.close()


async def test_a_half_read_response_closes_its_connection_and_a_closed_one_is_not_reused(serve) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            if body == b"long":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            if body == b"bye":
                return  # closes the kept-alive connection while the client holds it idle

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    origin = server.origin
    conn = await client.send(origin, request_head("POST", origin, "/", {}, 4), b"long")
    assert await conn.readany() == b"first"
    client.release(conn)  # the client hung up mid-stream
    assert await post(client, origin, b"ok") == (200, b"ok")
    assert server.connections == 2
    assert await post(client, origin, b"bye") == (200, b"ok")
    await asyncio.sleep(0.05)  # the server's FIN arrives while the connection sits idle
    assert await asyncio.wait_for(post(client, origin, b"ok"), 5) == (200, b"ok")  # reused, it would hang
    assert server.connections == 3
    client.close()


async def test_a_request_crossed_by_the_servers_keep_alive_close_is_sent_again_on_a_new_connection(serve) -> None:
    """The server closes a kept-alive connection as the next request arrives on it,
    unread (its keep-alive ran out): the client sends it once more on a new connection.
    A connection that closes after some bytes of an answer is not retried."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request's head arrives, and is never answered
        if body == b"partial":
            writer.write(b"HTTP/1.1 200 O")
            await writer.drain()

    server = await serve(handler)
    client = HttpClient(limit=4, keepalive_s=15, connect_s=5)
    origin = server.origin
    assert await post(client, origin, b"first") == (200, b"ok")
    assert await asyncio.wait_for(post(client, origin, b"again"), 5) == (200, b"ok")  # on a second connection
    assert server.connections == 2
    assert await post(client, origin, b"partial") == (200, b"ok")  # on the second connection's successor
    with pytest.raises(ConnectFailedError):
        await post(client, origin, b"x")  # half a status line came: not sent again
    assert server.connections == 3
    client.close()


async def test_at_most_limit_requests_are_in_flight(serve) -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    server = await serve(handler)
    client = HttpClient(limit=2, keepalive_s=15, connect_s=5)
    calls = [asyncio.create_task(post(client, server.origin)) for _ in range(3)]
    await asyncio.sleep(0.1)
    assert server.connections == 2
    release.set()
    assert await asyncio.gather(*calls) == [(200, b"ok")] * 3
    client.close()


async def test_a_large_body_pauses_the_socket_and_arrives_whole(serve) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB, past the high-water mark

    server = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload))
    client = HttpClient(limit=2, keepalive_s=15, connect_s=5)
    conn = await client.send(server.origin, request_head("POST", server.origin, "/", {}, 0), b"")
    await asyncio.sleep(0.2)  # let the server fill the buffer while nobody reads
    assert conn._buffered <= 2 * (1 << 18) + 65536  # paused near the mark, not holding all 2 MiB
    assert await conn.read() == payload
    client.release(conn)
    client.close()


async def test_a_stalled_read_fails_with_the_exception_set_on_it(serve) -> None:
    server = await serve(answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"))
    client = HttpClient(limit=2, keepalive_s=15, connect_s=5)
    conn = await client.send(server.origin, request_head("POST", server.origin, "/", {}, 0), b"")
    pending = asyncio.create_task(conn.readany())
    await asyncio.sleep(0.05)
    conn.set_exception(TimeoutError("stalled"))
    with pytest.raises(TimeoutError, match="stalled"):
        await pending
    client.release(conn)
    assert not conn.reusable
    client.close()


def test_a_head_refuses_line_breaks_and_characters_outside_latin1() -> None:
    origin = Origin.of("http://[::1]:8000/prefix")
    assert origin == Origin("http", "::1", 8000) and origin.host_header() == "[::1]:8000"
    assert Origin.of("https://engine.example").host_header() == "engine.example"
    with pytest.raises(ValueError, match="line break"):
        request_head("POST", origin, "/", {"x-request-id": "a\r\nX-Evil: 1"}, 0)
    with pytest.raises(ValueError, match="Latin-1"):
        request_head("POST", origin, "/", {"authorization": "Bearer \u2603"}, 0)
    with pytest.raises(ValueError, match="not an http"):
        Origin.of("ftp://host/")


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


async def test_an_https_upstream_is_verified_and_served(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                _, body = await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=served)
    origin = Origin("https", "127.0.0.1", server.sockets[0].getsockname()[1])
    trusting = HttpClient(limit=2, keepalive_s=15, connect_s=5, tls=ssl.create_default_context(cafile=cert))
    assert await post(trusting, origin, b"secret") == (200, b"secret")
    assert await post(trusting, origin, b"again") == (200, b"again")  # over the kept-alive TLS connection
    default = HttpClient(limit=2, keepalive_s=15, connect_s=5)  # the system's CAs do not know this certificate
    with pytest.raises(ConnectFailedError, match="CERTIFICATE_VERIFY_FAILED"):
        await post(default, origin)
    trusting.close()
    default.close()
    server.close()
