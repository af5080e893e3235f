"""`infernet ui`: a read-only page of the network and its jobs, served on 127.0.0.1 (issue 27).

Rules of this file:
- The page is served by this process (``serve``), never by the agent: each request it answers asks
  the running agent over its control channel (agent/channel.py, the Unix socket in its home) for
  ``peers``, ``job.list`` or ``job.show``, as the CLI does. Nothing listens beyond 127.0.0.1.
- The page and every API request carry the token this process drew at start (``secrets.token_urlsafe``),
  in the URL's ``token`` query (the page) or the ``X-Infernet-Token`` header (its API calls), compared
  in constant time; without it, or with another: 403 and no body. The static files (the package's
  own script, style and chart library; no data) are served without it. Like Jupyter's, the URL printed at
  start holds the token.
- Read only: GET of the page, its static files (agent/ui/static: the page, its script and style,
  and uPlot 1.6.32, MIT, for the charts; nothing is fetched from anywhere else) and three API
  paths. Any other method is 405; an unknown path 404; an agent that does not answer is 502 with
  the one-line reason as JSON.
"""

from __future__ import annotations

import hmac
import json
import mimetypes
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlparse

STATIC = Path(__file__).resolve().parent / "static"
FILES = {"/": "index.html", "/static/app.js": "app.js", "/static/style.css": "style.css",
         "/static/uPlot.iife.min.js": "uPlot.iife.min.js", "/static/uPlot.min.css": "uPlot.min.css"}
MAX_JOB_ID = 128


class UiServer:
    """The page's HTTP server on 127.0.0.1:``port`` (0: a free one), answering from ``ask(method, **params)``."""

    def __init__(self, ask: Callable[..., Any], port: int = 0, token: str | None = None):
        self.ask = ask
        self.token = token or secrets.token_urlsafe(24)
        handler = type("Handler", (_Handler,), {"ui": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/?token={self.token}"

    def start(self) -> "UiServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="infernet-ui", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def api(self, path: str) -> Any:
        """The JSON an API path answers (LookupError: no such path)."""
        if path == "/api/peers":
            return self.ask("peers")
        if path == "/api/jobs":
            return self.ask("job.list")
        if path.startswith("/api/jobs/"):
            job = unquote(path[len("/api/jobs/"):])
            if not job or len(job) > MAX_JOB_ID or not all(c in "0123456789abcdef" for c in job):
                raise LookupError(path)
            return self.ask("job.show", job=job)
        raise LookupError(path)


class _Handler(BaseHTTPRequestHandler):
    ui: UiServer
    server_version = "infernet-ui"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the CLI prints the URL only
        pass

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self, query: dict) -> bool:
        given = self.headers.get("X-Infernet-Token") or (query.get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self.ui.token.encode())

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        # the page and the API need the token; the static files (the package's own, no data) do not
        if not url.path.startswith("/static/") and not self._authorized(parse_qs(url.query)):
            self._send(403)
            return
        if url.path in FILES:
            name = FILES[url.path]
            kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
            self._send(200, (STATIC / name).read_bytes(), f"{kind}; charset=utf-8" if kind.startswith("text/")
                       or kind.endswith("javascript") else kind)
            return
        try:
            answer = self.ui.api(url.path)
        except LookupError:
            self._send(404, b'{"error": "no such page"}')
            return
        except Exception as error:  # noqa: BLE001 - the agent's one line (ControlError, no agent running, ...)
            self._send(502, json.dumps({"error": str(error).splitlines()[0] if str(error) else type(error).__name__})
                       .encode())
            return
        self._send(200, json.dumps(answer, default=str).encode())

    do_HEAD = do_GET

    def _refuse(self) -> None:
        self._send(405)

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse
