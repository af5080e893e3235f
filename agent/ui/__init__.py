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
- Read only, but for one thing: GET of the page, its static files (agent/ui/static: the page, its
  script and style, and uPlot 1.6.32, MIT, for the charts; nothing is fetched from anywhere else) and
  the API paths; and the quick-inference box of a finished job (the seeds' training tab): POST
  ``/api/jobs/ID/infer`` ``{"prompt": TEXT}`` answers from the base model with the job's last
  aggregate and from the base alone (``infer``, agent/pipeline: the agent fetches the aggregate by
  its CID and checks the base model's hash), one request at a time, the model kept for the next;
  ``/api/jobs/ID/prompts`` offers prompts of the job's validation split (fetched by its CID through the
  agent into HOME/ui). Other methods are 405; an
  unknown path 404; a body over 64 KiB 413; an agent that does not answer, or a job with no
  aggregate yet, 502 with the one-line reason as JSON.
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

    def __init__(self, ask: Callable[..., Any], port: int = 0, token: str | None = None, home: Path | None = None):
        self.ask = ask
        self.inference = Inference(home)
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
        """The JSON a GET of an API path answers (LookupError: no such path)."""
        if path == "/api/peers":
            return self.ask("peers")
        if path == "/api/jobs":
            return self.ask("job.list")
        job, rest = _job_path(path)
        if rest == "":
            return self.ask("job.show", job=job)
        if rest == "/prompts":
            return {"prompts": self.inference.prompts(job, self.ask("job.show", job=job))}
        raise LookupError(path)

    def post(self, path: str, body: Any) -> Any:
        job, rest = _job_path(path)
        if rest != "/infer":
            raise LookupError(path)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > MAX_PROMPT:
            raise ValueError(f"prompt: expected text of 1 to {MAX_PROMPT} characters")
        return self.inference.answer(job, prompt)


MAX_PROMPT = 8000
MAX_BODY = 64 << 10


def _job_path(path: str) -> tuple[str, str]:
    """(job ID, the rest) of ``/api/jobs/ID[/...]``; LookupError for anything else."""
    if not path.startswith("/api/jobs/"):
        raise LookupError(path)
    job, _, rest = unquote(path[len("/api/jobs/"):]).partition("/")
    if not job or len(job) > MAX_JOB_ID or not all(c in "0123456789abcdef" for c in job):
        raise LookupError(path)
    return job, "/" + rest if rest else ""


class Inference:
    """The quick-inference box: the job's last aggregate on its base model, loaded once per job and kept
    (agent/pipeline: resolve_source fetches the aggregate through the agent and checks the base's hash)."""

    def __init__(self, home: Path | None, max_new_tokens: int = 64):
        self.home = home
        self.max_new_tokens = max_new_tokens
        self.lock = threading.Lock()
        self.loaded: dict[str, tuple[Any, Any, Any]] = {}  # job -> (source, model, tokenizer)

    def _load(self, job: str) -> tuple[Any, Any, Any]:
        if job not in self.loaded:
            from agent.pipeline.infer import load_model
            from agent.pipeline.source import resolve_source

            source = resolve_source(job, home=self.home)
            model, tokenizer = load_model(source, device="auto")
            self.loaded = {job: (source, model, tokenizer)}  # one model in memory at a time
        return self.loaded[job]

    def prompts(self, job: str, detail: dict, n: int = 5) -> list[str]:
        """Up to ``n`` user prompts of the job's validation split (fetched by CID through the agent, once)."""
        from agent.channel import request
        from agent.pipeline.infer import sample_prompts

        cid = (detail.get("dataset_cids") or {}).get("validation")
        if cid is None or self.home is None:
            return []
        path = self.home / "ui" / f"{cid}.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            request(self.home, "data.get", timeout=120, cid=cid, out=str(path), max_size=64 << 20)
        return [item["messages"][-1]["content"] for item in sample_prompts(path, n, 0)]

    def answer(self, job: str, prompt: str) -> dict:
        from agent.pipeline.infer import GenerationOptions, generate

        options = GenerationOptions(temperature=0.0, max_new_tokens=self.max_new_tokens, seed=0)
        messages = [{"role": "user", "content": prompt}]
        with self.lock:
            source, model, tokenizer = self._load(job)
            tuned = generate(model, tokenizer, messages, options)
            with model.disable_adapter():
                base = generate(model, tokenizer, messages, options)
        return {"job": job, "round": getattr(source.provenance, "round", None), "prompt": prompt,
                "answer": tuned, "base_answer": base}


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

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        if not self._authorized({}):  # the header only: a write never rides on a URL
            self._send(403)
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._send(413)
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            answer = self.ui.post(url.path, body)
        except LookupError:
            self._send(405 if not url.path.startswith("/api/jobs/") else 404)
            return
        except ValueError as error:  # a bad body (JSON, prompt)
            self._send(400, json.dumps({"error": str(error).splitlines()[0]}).encode())
            return
        except Exception as error:  # noqa: BLE001 - no aggregate yet, the agent's one line, a model that will not load
            self._send(502, json.dumps({"error": str(error).splitlines()[0] if str(error) else type(error).__name__})
                       .encode())
            return
        self._send(200, json.dumps(answer).encode())

    def _refuse(self) -> None:
        self._send(405)

    do_PUT = do_DELETE = do_PATCH = _refuse
