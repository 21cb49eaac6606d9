"""A webhook receiver for tests: a real HTTP server on loopback that keeps every delivery
(body and headers) and can answer 503 to the first attempts of each new event."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self):
        self.deliveries: list[tuple[bytes, dict[str, str]]] = []
        self.fail_first = 0  # answer 503 to this many attempts of each event first seen now
        self._failing: dict[str, int] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                self.send_response(receiver.answer(body, dict(self.headers.items())))
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: bytes, headers: dict[str, str]) -> int:
        with self._lock:
            self.deliveries.append((body, headers))
            webhook_id = headers["webhook-id"]
            if webhook_id not in self._failing:
                self._failing[webhook_id] = self.fail_first
            if self._failing[webhook_id] > 0:
                self._failing[webhook_id] -= 1
                return 503
        return 200

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
