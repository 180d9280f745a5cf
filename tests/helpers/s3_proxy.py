"""A fault-making HTTP proxy in front of the real S3 server (tests/helpers/s3_server.py), for the faults the server
cannot make itself: a response cut short, a 5xx, a stalled response, a throttled store (503 SlowDown for the first
few requests). It forwards every request unchanged (the Host header too: the client's signature stays valid) and
spoils only the requests of :attr:`Proxy.methods` (GETs by default) whose path holds :attr:`Proxy.target`."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request '
             b'rate.</Message></Error>')
INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered an '
            b'internal error. Please try again.</Message></Error>')


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _forward(self) -> None:
        proxy: Proxy = self.server.proxy  # type: ignore[attr-defined]
        n = int(self.headers.get("Content-Length", 0) or 0)
        body = self.rfile.read(n) if n else None
        spoil = self.command in proxy.methods and proxy.target in self.path
        if spoil:
            proxy.spoiled += 1
        if spoil and proxy.mode in ("error", "throttle") and (proxy.mode == "error" or proxy.spoiled <= proxy.times):
            payload = INTERNAL if proxy.mode == "error" else SLOW_DOWN
            self.send_response(500 if proxy.mode == "error" else 503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if spoil and proxy.mode == "stall":
            time.sleep(proxy.stall_s)
        up = urllib.parse.urlsplit(proxy.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
        try:
            conn.request(self.command, self.path, body, headers=dict(self.headers))
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if spoil and proxy.mode == "cut" and len(data) > 1:
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:  # a client that gave up: expected
        pass


class Proxy:
    """``with Proxy(upstream, mode, target) as p:`` — ``p.endpoint`` for the client's profile."""

    def __init__(self, upstream: str, mode: str, target: str, *, times: int = 1, stall_s: float = 5.0,
                 methods: tuple[str, ...] = ("GET",)) -> None:
        if mode not in ("cut", "error", "stall", "throttle"):
            raise ValueError(mode)
        self.upstream, self.mode, self.target, self.times, self.stall_s = upstream, mode, target, times, stall_s
        self.methods = methods
        self.spoiled = 0
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self  # type: ignore[attr-defined]
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
