"""A real S3 API server for the object-storage tests: moto's server mode on a free localhost port, the standard
AWS environment pointed at it, and a small HTTP proxy in front of it that injects faults (503 SlowDown, dropped
connections) and can hold chosen requests on an event (for kill and race tests, no sleeps)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

BUCKET = "fastckpt-test"

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_server() -> Iterator[str]:
    """Body of the session fixture ``s3_endpoint``: moto on a free port, AWS_* set for it, the test bucket made;
    yields the endpoint URL and stops the server (and restores the environment) afterwards."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"]}
    os.environ.update(env)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    try:
        client().create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        del boto3


def client():
    """A boto3 S3 client on the test server (the reference client for what is in the bucket)."""
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def keys(prefix: str) -> list[str]:
    """Every key under ``prefix`` in the test bucket (boto3 paginated listing)."""
    found: list[str] = []
    for page in client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found += [o["Key"] for o in page.get("Contents", [])]
    return sorted(found)


def pending_uploads(prefix: str) -> list[str]:
    """Keys with multipart uploads still open under ``prefix``."""
    listed = client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
    return sorted(u["Key"] for u in listed.get("Uploads", []))


@dataclass
class Faults:
    """What the proxy does: the first ``count`` requests matching ``match`` get ``kind`` (``"503"``: a SlowDown
    response; ``"drop"``: the connection closed without a response); ``count=None`` faults every one.
    ``hold(method, path)``, when set, is called before a request is forwarded (it may block on an event); requests
    that ``serialize`` matches are forwarded one at a time (moto's conditional writes are not atomic, S3's are)."""

    kind: str = "none"
    count: int | None = 0
    match: Callable[[str, str], bool] = lambda method, path: method in ("PUT", "POST")
    hold: Callable[[str, str], None] | None = None
    serialize: Callable[[str, str], bool] = lambda method, path: False
    injected: int = 0
    seen: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    forward_lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, method: str, path: str) -> str | None:
        with self.lock:
            self.seen.append(f"{method} {path}")
            if self.kind == "none" or not self.match(method, path):
                return None
            if self.count is not None and self.injected >= self.count:
                return None
            self.injected += 1
            return self.kind


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        faults = self.server.faults
        if faults.hold is not None:
            faults.hold(self.command, self.path)
        kind = faults.take(self.command, self.path)
        if kind == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if kind == "503":
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            self.wfile.write(SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        try:  # closed even when the client is gone (a killed saver): no socket left for the GC to warn about
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "proxy-connection")}
            serial = faults.forward_lock if faults.serialize(self.command, self.path) else contextlib.nullcontext()
            with serial:
                upstream.request(self.command, self.path, body=body, headers=headers)
                reply = upstream.getresponse()
                data = reply.read()
        finally:
            upstream.close()
        self.send_response(reply.status, reply.reason)
        for k, v in reply.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any


class _ProxyServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:  # a client that was killed or gave up: quiet
        pass

    def __init__(self, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_port = upstream_port
        self.faults = Faults()


class FaultProxy:
    """``with FaultProxy(endpoint) as proxy:``: an HTTP proxy in front of the server; ``proxy.endpoint`` is its URL
    and ``proxy.faults`` (a :class:`Faults`) says what it injects."""

    def __init__(self, endpoint: str) -> None:
        self._server = _ProxyServer(int(endpoint.rsplit(":", 1)[1]))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def faults(self) -> Faults:
        return self._server.faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        self._server.faults = value

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def key_prefix(url: str) -> str:
    """The key prefix of an ``s3://fastckpt-test/...`` URL of the test bucket."""
    return url.split(f"s3://{BUCKET}/", 1)[1]


def proxy_options(proxy: FaultProxy, retries: int = 6) -> dict[str, str]:
    """``storage_options`` that send every request through ``proxy``: quick retries, 5 MiB multipart parts."""
    return {"endpoint_url": proxy.endpoint, "max_retries": str(retries), "retry_backoff": "0.01",
            "part_size": str(5 << 20)}
