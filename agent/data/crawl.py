"""``infernet train data``: pages from a search, a URL list, a sitemap or a directory, to ChatML JSONL.

Rules of this file:
- Polite fetching (``PoliteFetcher``): robots.txt is read once per host (urllib.robotparser, as
  ``User-agent: infernet-data``) and obeyed; a robots.txt that answers 4xx allows everything, one
  that answers 5xx forbids the host for this run (RFC 9309). Requests to one host are at least
  ``delay`` seconds apart (or robots.txt's Crawl-delay, up to 30 s). Redirects are followed one hop
  at a time, each target checked against robots.txt before it is requested. A request that times out, cannot
  connect, or answers 429/5xx is tried again ``retries`` times, waiting 0.5 s, 1 s, 2 s... (or the
  server's Retry-After, up to 30 s). Every request has a whole-request deadline and a size cap
  (agent/data/http.py).
- A page that cannot be used is skipped with a reason (``robots.txt disallows``, ``timeout``,
  ``too large``, ``HTTP 404``, ``not text``, ``no readable text``...), counted in the summary, and
  never stops the run. What stops the run before anything is fetched, as one ``DataSourceError``
  line: an unwritable ``--out``, a bad line in ``--urls``, a sitemap or search that cannot be read.
- Passages are deduplicated across the whole run (passages.text_key); URLs are fetched once
  (fragment dropped). The output is written at the end to a temporary file in the same directory,
  then renamed over ``--out``: a failed or interrupted run leaves nothing half-written. A run that
  would write no record fails instead.
- Only the fetching thread runs: pages are fetched one after another (the per-host delay is the
  politeness, not parallelism).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.robotparser
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence
from urllib.parse import urldefrag, urljoin, urlsplit

from agent.data import DataSourceError
from agent.data.http import ROBOTS_AGENT, FetchFailed, Response, check_http_url, http_get
from agent.data.passages import (Extracted, chunk, html_blocks, make_records, markdown_blocks, text_blocks,
                                 text_key)

if TYPE_CHECKING:
    from agent.data.search import SearchProvider

RETRY_STATUSES = {429, 500, 502, 503, 504}
REDIRECTS = {301, 302, 303, 307, 308}
MAX_REDIRECTS = 5
MAX_WAIT = 30.0
MAX_SITEMAPS = 50
HTML_TYPES = {"text/html", "application/xhtml+xml"}
MARKDOWN_TYPES = {"text/markdown", "text/x-markdown"}
LOCAL_SUFFIXES = {".html": "html", ".htm": "html", ".xhtml": "html", ".md": "markdown", ".markdown": "markdown",
                  ".txt": "text", ".text": "text"}


@dataclass(frozen=True)
class FetchPolicy:
    timeout: float = 20.0  # seconds for one whole request, connect to last byte
    max_bytes: int = 5 << 20
    retries: int = 2
    delay: float = 1.0  # seconds between two requests to one host


class Skipped(Exception):
    """A page not used; ``reason`` is short and shared by like pages (the summary counts by it)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason} ({detail})" if detail else reason)


class PoliteFetcher:
    """GETs that obey robots.txt, keep a per-host delay and retry transient failures."""

    def __init__(self, policy: FetchPolicy, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.sleep = sleep
        self.clock = clock
        self.robots: dict[str, urllib.robotparser.RobotFileParser | Skipped] = {}
        self.next_time: dict[str, float] = {}
        self.delays: dict[str, float] = {}
        self.requests = 0

    def get(self, url: str) -> Response:
        """The page at ``url`` (status 200), or Skipped with the reason. Redirects are followed here,
        hop by hop (at most ``MAX_REDIRECTS``), each target checked against its robots.txt first."""
        start = url
        for _ in range(MAX_REDIRECTS + 1):
            if not self._robots(_origin(url)).can_fetch(ROBOTS_AGENT, url):
                raise Skipped("robots.txt disallows", "" if url == start else f"redirected to {url}")
            response = self._get(url)
            location = response.headers.get("Location") if response.status in REDIRECTS else None
            if not location:
                break
            url = urljoin(url, location.strip())
            try:
                check_http_url(url)
            except ValueError:
                raise Skipped("bad redirect", location[:200]) from None
        else:
            raise Skipped("too many redirects")
        if response.status != 200:
            raise Skipped(f"HTTP {response.status}")
        return response

    def _robots(self, origin: str) -> urllib.robotparser.RobotFileParser:
        known = self.robots.get(origin)
        if known is None:
            known = self.robots[origin] = self._read_robots(origin)
        if isinstance(known, Skipped):
            raise known
        return known

    def _read_robots(self, origin: str) -> urllib.robotparser.RobotFileParser | Skipped:
        parser = urllib.robotparser.RobotFileParser(origin + "/robots.txt")
        try:
            response = self._get(origin + "/robots.txt", max_bytes=512 * 1024, redirects=True)
        except Skipped as skipped:
            return skipped  # the host does not answer: neither will its pages
        if response.status >= 500:
            return Skipped("robots.txt unavailable", f"HTTP {response.status}")
        if response.status >= 400:
            parser.allow_all = True
        else:
            parser.parse(response.text().splitlines())
            crawl_delay = parser.crawl_delay(ROBOTS_AGENT)
            if crawl_delay:
                self.delays[origin] = min(MAX_WAIT, float(crawl_delay))
        return parser

    def _get(self, url: str, *, max_bytes: int | None = None, redirects: bool = False) -> Response:
        """One GET with the host's delay and the retries; any HTTP status is returned."""
        origin = _origin(url)
        attempt = 0
        while True:
            wait = self.next_time.get(origin, 0.0) - self.clock()
            if wait > 0:
                self.sleep(wait)
            retry_after = None
            try:
                self.requests += 1
                response = http_get(url, timeout=self.policy.timeout, max_bytes=max_bytes or self.policy.max_bytes,
                                    redirects=redirects)
                failure = None if response.status not in RETRY_STATUSES else Skipped(f"HTTP {response.status}")
                retry_after = _retry_after(response) if failure else None
            except FetchFailed as error:
                response, failure = None, Skipped(error.reason, error.detail)
                if error.reason in ("too large", "bad URL"):  # trying again gives the same answer
                    attempt = self.policy.retries
            finally:
                self.next_time[origin] = self.clock() + max(self.policy.delay, self.delays.get(origin, 0.0))
            if failure is None or attempt >= self.policy.retries:
                if response is not None:
                    return response
                raise failure
            attempt += 1
            self.sleep(min(MAX_WAIT, retry_after if retry_after is not None else 0.5 * 2 ** (attempt - 1)))


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _retry_after(response: Response) -> float | None:
    value = (response.headers.get("Retry-After") or "").strip()
    return min(MAX_WAIT, float(value)) if value.isdigit() else None


def normalize_url(url: str) -> str:
    return urldefrag(url.strip())[0]


# -- sources -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Document:
    """One page or file to turn into records: an http(s) URL, or a local file (``path`` set)."""

    url: str
    path: Path | None = None


def read_url_list(path: Path) -> list[str]:
    """URLs of a ``--urls`` file: one a line, ``#`` comments and blank lines skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataSourceError(f"{path}: cannot read the URL list: {getattr(error, 'strerror', None) or error}") from None
    urls = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            urls.append(check_http_url(line))
        except ValueError as error:
            raise DataSourceError(f"{path}:{number}: {error}") from None
    return urls


def read_sitemap(fetcher: PoliteFetcher, url: str) -> list[str]:
    """Page URLs of a sitemap (``<urlset>``), following a ``<sitemapindex>`` to at most 50 sitemaps."""
    try:
        check_http_url(url)
    except ValueError as error:
        raise DataSourceError(f"--sitemap: {error}") from None
    pages: list[str] = []
    queue, seen = [url], set()
    while queue and len(seen) < MAX_SITEMAPS:
        current = queue.pop(0)
        if current in seen:
            continue
        seen.add(current)
        try:
            response = fetcher.get(current)
            body = response.body
            if body[:2] == b"\x1f\x8b":  # sitemap.xml.gz
                body = _gunzip(body, fetcher.policy.max_bytes)
            root = ET.fromstring(body)
        except Skipped as skipped:
            raise DataSourceError(f"sitemap {current}: {skipped}") from None
        except ET.ParseError as error:
            raise DataSourceError(f"sitemap {current}: not a sitemap XML ({error})") from None
        kind = root.tag.rsplit("}", 1)[-1]
        locs = [(el.text or "").strip() for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "loc"]
        locs = [urljoin(current, loc) for loc in locs if loc]
        if kind == "sitemapindex":
            queue.extend(locs)
        elif kind == "urlset":
            pages.extend(loc for loc in locs if urlsplit(loc).scheme in ("http", "https"))
        else:
            raise DataSourceError(f"sitemap {current}: not a sitemap (root element <{kind}>)")
    return pages


def _gunzip(data: bytes, max_bytes: int) -> bytes:
    """Decompress gzip ``data`` to at most ``max_bytes`` (a small bomb cannot fill the memory)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, max_bytes + 1)
    except zlib.error as error:
        raise ET.ParseError(f"bad gzip: {error}") from None
    if len(out) > max_bytes:
        raise ET.ParseError(f"more than {max_bytes} bytes once decompressed")
    return out


def local_documents(directory: Path) -> list[Document]:
    """HTML, Markdown and text files under ``directory`` (hidden ones left out), in path order."""
    if not directory.is_dir():
        raise DataSourceError(f"--dir {directory}: not a directory")
    documents = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(root) / name
            if not name.startswith(".") and path.suffix.lower() in LOCAL_SUFFIXES:
                documents.append(Document(path.relative_to(directory).as_posix(), path))
    return sorted(documents, key=lambda d: d.url)


# -- building the dataset -------------------------------------------------------------------------------------

@dataclass
class BuildReport:
    out: str
    documents: int = 0
    fetched: int = 0
    records: int = 0
    chars: int = 0
    duplicates: int = 0
    too_short: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (url, reason)
    requests: int = 0

    def skipped_by_reason(self) -> dict[str, int]:
        return dict(Counter(reason.split(" (")[0] for _, reason in self.skipped).most_common())

    def to_json(self) -> dict:
        return {"out": self.out, "documents": self.documents, "pages_fetched": self.fetched,
                "records": self.records, "chars": self.chars, "duplicates_dropped": self.duplicates,
                "short_passages_dropped": self.too_short, "requests": self.requests,
                "skipped": [{"url": u, "reason": r} for u, r in self.skipped],
                "skipped_by_reason": self.skipped_by_reason()}


def check_writable(out: Path) -> None:
    """Fail now, before any fetch, if ``out`` cannot be written (as a rename of a temp file beside it)."""
    parent = out.parent
    if out.is_dir():
        raise DataSourceError(f"--out {out}: is a directory; give a file name")
    if not parent.is_dir():
        raise DataSourceError(f"--out {out}: directory {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{out.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise DataSourceError(f"--out {out}: cannot write in {parent}: {error.strerror or error}") from None


def load_document(fetcher: PoliteFetcher, document: Document, max_bytes: int) -> tuple[Extracted, str]:
    """The extracted text of a document and the URL to record as its source; Skipped if unusable."""
    if document.path is not None:
        try:
            size = document.path.stat().st_size
            if size > max_bytes:
                raise Skipped("too large", f"{size} bytes (limit {max_bytes})")
            body = document.path.read_bytes()
        except OSError as error:
            raise Skipped("unreadable", error.strerror or str(error)) from None
        kind = LOCAL_SUFFIXES[document.path.suffix.lower()]
        source = document.url
    else:
        response = fetcher.get(document.url)
        ctype = response.content_type
        if ctype in HTML_TYPES or (not ctype and response.body.lstrip()[:1] == b"<"):
            kind = "html"
        elif ctype in MARKDOWN_TYPES or (ctype == "text/plain" and urlsplit(response.url).path.endswith((".md", ".markdown"))):
            kind = "markdown"
        elif ctype == "text/plain":
            kind = "text"
        else:
            raise Skipped("not text", ctype or "no content type")
        body, source = response.body, normalize_url(response.url)
    if kind == "html":
        return html_blocks(body, source if document.path is None else None), source
    text = body.decode("utf-8", errors="replace") if document.path is not None else response.text()
    return (markdown_blocks(text) if kind == "markdown" else text_blocks(text)), source


def build_dataset(documents: Sequence[Document], out: Path, *, fetcher: PoliteFetcher, min_chars: int = 200,
                  max_chars: int = 4000, progress: Callable[[str], None] | None = None) -> BuildReport:
    """Fetch, extract, chunk and deduplicate ``documents`` into ChatML records at ``out`` (atomically)."""
    report = BuildReport(str(out))
    records: list[dict] = []
    seen_text: set[bytes] = set()
    seen_url: set[str] = set()
    for document in documents:
        key = document.url if document.path is not None else normalize_url(document.url)
        if key in seen_url:
            continue
        seen_url.add(key)
        report.documents += 1
        try:
            extracted, source = load_document(fetcher, document, fetcher.policy.max_bytes)
            report.fetched += 1
            passages, short = chunk(extracted.blocks, min_chars, max_chars)
            report.too_short += short
            if not passages:
                raise Skipped("no readable text", f"no passage of {min_chars}+ characters")
            fresh = []
            for passage in passages:
                digest = text_key(passage.text)
                if digest in seen_text:
                    report.duplicates += 1
                    continue
                seen_text.add(digest)
                fresh.append(passage)
            host = urlsplit(source).hostname or source
            records.extend(make_records(fresh, title=extracted.title, source_url=source, source=host))
        except Skipped as skipped:
            report.skipped.append((document.url, str(skipped)))
        finally:
            if progress is not None:
                progress(document.url)
    report.requests = fetcher.requests
    report.records = len(records)
    report.chars = sum(len(r["messages"][1]["content"]) for r in records)
    if not records:
        reasons = ", ".join(f"{n} {reason}" for reason, n in report.skipped_by_reason().items())
        raise DataSourceError(f"no records to write to {out}: {report.documents} pages or files"
                              + (f", skipped: {reasons}" if reasons else "")
                              + (f", {report.duplicates} duplicate passages" if report.duplicates else ""))
    write_atomically(out, records)
    return report


def write_atomically(out: Path, records: Iterable[dict]) -> None:
    """Records as ChatML JSONL (the layout of agent.train.data.write_chatml, one compact object a line),
    written to a temporary file beside ``out`` and renamed over it."""
    handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=out.parent, prefix=f".{out.name}.",
                                         suffix=".tmp", delete=False)
    try:
        with handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)  # as an ordinary new file, not the temp file's 0600
        os.replace(handle.name, out)
    except BaseException:
        try:
            os.unlink(handle.name)
        except OSError:
            pass
        raise


def gather_documents(fetcher: PoliteFetcher, *, query: str | None = None, domains: Sequence[str] = (),
                     num: int | None = None, provider: "SearchProvider | None" = None,
                     urls_file: Path | None = None, sitemaps: Sequence[str] = (),
                     directory: Path | None = None) -> list[Document]:
    """The documents of every source given, in order (search, URL list, sitemaps, directory), each URL
    once and only on ``domains`` when some are given, at most ``num`` in all when it is set (the search
    asks for ``num``, 10 if unset)."""
    urls: list[str] = []
    if query is not None:
        if provider is None:
            raise DataSourceError("--query needs a search provider")
        results = provider.search(query, domains=domains, num=num or 10)
        if not results:
            raise DataSourceError(f"the search for {query!r} found no pages"
                                  + (f" on {', '.join(domains)}" if domains else ""))
        urls += [r.url for r in results]
    if urls_file is not None:
        urls += read_url_list(urls_file)
    for sitemap in sitemaps:
        urls += read_sitemap(fetcher, sitemap)
    if domains:
        urls = [u for u in urls if _in_domains(u, domains)]
    documents = [Document(u) for u in dict.fromkeys(normalize_url(u) for u in urls)]
    if directory is not None:
        documents += local_documents(directory)
    return documents[:num] if num else documents


def _in_domains(url: str, domains: Sequence[str]) -> bool:
    from agent.data.search import host_in

    return host_in(url, domains)


def render_summary(report: BuildReport, *, most_skipped: int = 20) -> str:
    lines = [f"wrote {report.records} records ({report.chars} characters of passages) to {report.out}",
             f"  {report.documents} pages or files: {report.fetched} fetched, {len(report.skipped)} skipped; "
             f"{report.requests} HTTP requests"]
    if report.duplicates or report.too_short:
        lines.append(f"  dropped {report.duplicates} duplicate passages, {report.too_short} too short")
    if report.skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in report.skipped_by_reason().items())
        lines.append(f"  skipped {len(report.skipped)}: {reasons}")
        lines += [f"    {url}: {reason}" for url, reason in report.skipped[:most_skipped]]
        if len(report.skipped) > most_skipped:
            lines.append(f"    ... and {len(report.skipped) - most_skipped} more (--json lists all)")
    lines.append(f"next: infernet data check {report.out}")
    return "\n".join(lines)
