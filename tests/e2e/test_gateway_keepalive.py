"""`kvrelay gateway` keeps an idle client connection `client_keepalive_s`, not uvicorn's 5 s:
a proxy in front (nginx keeps its upstream connections 60 s) sends a POST on a kept
connection, and a gateway that closed it as the POST went out would cost the client a 502."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


from kvrelay.gateway.settings import GatewaySettings
from tests.gateway.support import free_port
from tests.helpers import answers, wait_until

KVRELAY = [sys.executable, "-c", "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"]
HEALTH = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    """One whole response to GET /health on `sock` (head and its content-length body)."""
    sock.sendall(HEALTH)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def test_an_idle_client_connection_is_kept_for_client_keepalive_s(tmp_path):
    assert GatewaySettings().client_keepalive_s == 75  # longer than nginx's 60 s and the SDKs' own
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "OTEL_"))},
           "KVRELAY_CLIENT_KEEPALIVE_S": "1"}
    proc = subprocess.Popen([*KVRELAY, "gateway", "--port", str(port), "--upstream", "http://127.0.0.1:9",
                             "--database-url", f"sqlite+aiosqlite:///{tmp_path}/gw.db", "--log-level", "warning"],
                            env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers(f"{url}/health"), timeout=60, interval=0.1), \
            proc.stderr.read().decode() if proc.poll() else ""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert _answer(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
            assert _answer(sock).startswith(b"HTTP/1.1 200")  # kept within the setting
            time.sleep(2.0)
            sock.settimeout(1.0)  # 3 s idle at most: uvicorn's own 5 s would not have closed it yet
            assert sock.recv(4096) == b""  # closed by the gateway once idle past the setting
    finally:
        proc.terminate()
        proc.wait(timeout=30)
