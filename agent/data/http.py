"""One bounded HTTP(S) GET: the whole request, connect to last byte, under one deadline; the body
capped in bytes; only http and https. Politeness (robots.txt, per-host delay, retries) is crawl.py's.

Rules of this file:
- ``http_get`` returns a ``Response`` for any HTTP status (the caller decides what 404 or 503 mean)
  and raises ``FetchFailed(reason)`` when there is no answer to judge: unreachable, timed out, larger
  than the cap, not an http(s) URL. ``reason`` is a few words meant for a summary line.
- A Content-Length over the cap is refused before the body is read; without one, reading stops at
  cap + 1 bytes. The deadline is checked between reads, and each socket wait is bounded by what is
  left of it, so a server dripping one byte a second cannot hold us past ``timeout``.
- Redirects are followed (urllib's default: at most 10, http(s) only; ``Response.url`` is the last),
  unless ``redirects=False``: then a 3xx is returned as it is, for a caller that checks each hop.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from urllib.parse import urlsplit

from agent import __version__

USER_AGENT = f"infernet-data/{__version__} (dataset builder of infernet-agent)"
ROBOTS_AGENT = "infernet-data"
"""The name robots.txt rules are matched against (``User-agent: infernet-data``)."""
CHUNK = 64 * 1024


class FetchFailed(Exception):
    """No HTTP answer to judge; ``reason`` is short (``timeout``, ``unreachable``, ``too large``...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass
class Response:
    url: str
    status: int
    headers: Message
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get_content_type() if self.headers.get("Content-Type") else ""

    @property
    def charset(self) -> str | None:
        return self.headers.get_content_charset()

    def text(self) -> str:
        charset = self.charset or "utf-8"
        try:
            return self.body.decode(charset, errors="replace")
        except LookupError:  # an unknown charset name
            return self.body.decode("utf-8", errors="replace")


def check_http_url(url: str) -> str:
    """``url`` if it is an absolute http(s) URL with a host; else ValueError saying why."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url


class _KeepRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # noqa: ANN002 - urllib's signature
        return None  # urllib then raises the 3xx as an HTTPError: returned as a Response below


_NO_REDIRECTS = urllib.request.build_opener(_KeepRedirects)


def http_get(url: str, *, timeout: float, max_bytes: int, headers: dict[str, str] | None = None,
             redirects: bool = True) -> Response:
    """GET ``url``; see the rules at the top of this file."""
    try:
        check_http_url(url)
    except ValueError as error:
        raise FetchFailed("bad URL", str(error)) from None
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity",
                                                   **(headers or {})})
    try:
        response = (urllib.request.urlopen if redirects else _NO_REDIRECTS.open)(request, timeout=timeout)
    except urllib.error.HTTPError as error:  # a status >= 400 is still an answer
        with error:
            body = _read(error, deadline, max_bytes, url) if error.fp is not None else b""
        return Response(error.geturl() or url, error.code, error.headers, body)
    except (TimeoutError, socket.timeout):
        raise FetchFailed("timeout", f"no answer within {timeout:g} s") from None
    except urllib.error.URLError as error:
        reason = error.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise FetchFailed("timeout", f"no answer within {timeout:g} s") from None
        text = getattr(reason, "strerror", None) or str(reason)
        raise FetchFailed("unreachable", text) from None
    except (OSError, ValueError) as error:  # reset connections, bad ports, http.client oddities
        raise FetchFailed("unreachable", str(error) or type(error).__name__) from None
    with response:
        length = response.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > max_bytes:
            raise FetchFailed("too large", f"{int(length)} bytes (limit {max_bytes})")
        body = _read(response, deadline, max_bytes, url)
        return Response(response.geturl() or url, response.status, response.headers, body)


def _read(response, deadline: float, max_bytes: int, url: str) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchFailed("timeout", "body not complete in time")
        _set_timeout(response, left)
        try:
            part = response.read(min(CHUNK, max_bytes + 1 - size))
        except (TimeoutError, socket.timeout):
            raise FetchFailed("timeout", "body not complete in time") from None
        except (OSError, ValueError) as error:
            raise FetchFailed("unreachable", f"connection broke: {error}") from None
        if not part:
            return b"".join(parts)
        parts.append(part)
        size += len(part)
        if size > max_bytes:
            raise FetchFailed("too large", f"more than {max_bytes} bytes")


def _set_timeout(response, seconds: float) -> None:
    """Bound the next socket wait by what is left of the deadline (best effort: urllib hides the socket)."""
    fp = getattr(response, "fp", None)
    if fp is not None and not hasattr(fp, "raw"):  # an HTTPError wraps the HTTPResponse
        fp = getattr(fp, "fp", None)
    sock = getattr(getattr(fp, "raw", None), "_sock", None)
    if sock is not None:
        sock.settimeout(max(0.01, seconds))
