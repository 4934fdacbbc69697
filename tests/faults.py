"""Fault injection for S3 tests: an HTTP proxy in front of the real S3 server.

This is the one fake in the suite, and it only injects faults: every request
it lets through is answered by the real server. Modes per request, drawn at
the configured rates: ``slowdown`` (503 SlowDown), ``error`` (500
InternalError), ``reset`` (the TCP connection is reset, no response).
``hang`` makes every request wait without an answer (an outage).
``delay`` holds requests of a method (``{"PUT": 0.3}``) that long before
passing them on (a slow store). ``answer`` answers every request of a method
with that status and error code (``{"PUT": (404, "NoSuchKey")}``), unsent.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
    "<Message>injected by the test proxy</Message></Error>"
)


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.rates: dict[str, float] = {}
        self.hang = threading.Event()
        self.delay: dict[str, float] = {}
        self.answer: dict[str, tuple[int, str]] = {}
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.seen: Counter[str] = Counter()  # requests per (method path)
        self.injected: Counter[str] = Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (ConnectionError, TimeoutError):
                    self.close_connection = True

            def _any(self) -> None:
                body = self._body()
                with proxy.lock:
                    proxy.seen[f"{self.command} {self.path.split('?')[0]}"] += 1
                    draw = proxy.rng.random()
                mode = "pass"
                edge = 0.0
                for name, rate in proxy.rates.items():
                    edge += rate
                    if draw < edge:
                        mode = name
                        break
                if self.command in proxy.delay:
                    threading.Event().wait(proxy.delay[self.command])
                if proxy.hang.is_set():
                    proxy.hang_wait()
                    mode = "reset"
                if mode != "pass":
                    with proxy.lock:
                        proxy.injected[mode] += 1
                if mode == "reset":
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.close_connection = True
                    self.connection.close()
                    return
                if mode == "pass" and self.command in proxy.answer:
                    mode = "answer"
                    with proxy.lock:
                        proxy.injected[mode] += 1
                if mode in ("slowdown", "error", "answer"):
                    status, code = {
                        "slowdown": (503, "SlowDown"),
                        "error": (500, "InternalError"),
                        "answer": proxy.answer.get(self.command, (500, "InternalError")),
                    }[mode]
                    payload = _ERROR_XML.format(code=code).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self._forward(body)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self, body: bytes) -> None:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"
                }
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def hang_wait(self) -> None:
        while self.hang.is_set():
            self.hang.wait(0.05)
            if not self.hang.is_set():
                return
            threading.Event().wait(0.05)

    def stop(self) -> None:
        self.hang.clear()
        self.server.shutdown()
        self.server.server_close()
