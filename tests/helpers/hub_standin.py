"""A local stand-in for the Hugging Face Hub's API, enough for ``huggingface_hub``'s ``create_repo`` and
``create_commit``: it takes every file inline (the Hub's "regular" upload mode) and keeps each commit's
files under a folder, and the requests it was sent with their Authorization header. No network."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class StandIn:
    url: str
    repositories: Path  # <owner>/<name>/<path> of every file committed
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Authorization


@contextmanager
def hub_stand_in(repositories: Path) -> Iterator[StandIn]:
    """A running stand-in whose commits land in ``repositories``."""
    requests: list[tuple[str, str, str | None]] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            requests.append(("GET", self.path, self.headers.get("Authorization")))
            self.answer(404, {"error": "not in the stand-in"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            requests.append(("POST", self.path, self.headers.get("Authorization")))
            host = f"http://{self.headers['Host']}"
            if self.path == "/api/repos/create":
                asked = json.loads(body)
                return self.answer(200, {"url": f"{host}/{asked.get('organization') or 'me'}/{asked['name']}"})
            if self.path == "/api/validate-yaml":
                return self.answer(200, {"errors": [], "warnings": []})
            if "/preupload/" in self.path:
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self.answer(200, {"files": modes})
            if self.path.startswith("/api/models/") and "/commit/" in self.path:
                repository = self.path.removeprefix("/api/models/").split("/commit/")[0]
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        path = repositories / repository / item["value"]["path"]
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(base64.b64decode(item["value"]["content"]))
                return self.answer(200, {"commitUrl": f"{host}/{repository}/commit/0a1b2c", "commitOid": "0a1b2c"})
            return self.answer(404, {"error": f"{self.path} is not in the stand-in"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield StandIn(f"http://127.0.0.1:{server.server_address[1]}", repositories, requests)
    finally:
        server.shutdown()
        server.server_close()
