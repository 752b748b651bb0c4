"""A paid provider for tests: a real HTTP server on loopback that honours
``Idempotency-Key`` as Stripe does (a key it has seen answers its first charge again and
charges nothing) and counts charges and calls. Used by the idempotency-key tests and by
the chaos suite (``bench.chaos``), whose plays pay each row through it."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Provider(ThreadingHTTPServer):
    """Charges by idempotency key: ``charges`` per key, every call in ``calls``, and the
    keys each (run, step) came with in ``keys`` (a step is what the caller names it)."""

    daemon_threads = True
    request_queue_size = 128  # every worker's attempts may call at once

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.charges: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []  # (run, key)
        self.keys: dict[tuple[str, str], set[str]] = {}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: Provider

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = self.headers["Idempotency-Key"]
        with self.server.lock:
            self.server.calls.append((body["run"], key))
            self.server.keys.setdefault((body["run"], str(body.get("step"))), set()).add(key)
            charge = self.server.charges.setdefault(
                key, {"id": f"ch_{len(self.server.charges) + 1}", "amount": body["amount"]}
            )
        answer = json.dumps(charge).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


@contextlib.contextmanager
def serving() -> Iterator[Provider]:
    """A provider answering on loopback until the block ends."""
    server = Provider()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def charge(
    provider: str, key: str, run: str, amount: int, step: str | None = None
) -> dict[str, Any]:
    """A provider call as a play makes it: a POST with the key as its header."""
    host, port = provider.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = json.dumps({"run": run, "amount": amount, "step": step})
        conn.request(
            "POST",
            "/charges",
            body=body,
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )
        answer: dict[str, Any] = json.loads(conn.getresponse().read())
        return answer
    finally:
        conn.close()
