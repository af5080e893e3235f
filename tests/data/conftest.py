"""A real HTTP server on loopback (http.server in a thread) serving a small website: HTML pages with
navigation and footers, a Markdown note, a sitemap, a robots.txt forbidding /private/, a slow page,
a huge page, a flaky page (503 once), and a search API speaking ValueSerp's JSON."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

DANUBE = ("The Danube is Europe's second-longest river after the Volga. It rises in the Black Forest of Germany "
          "and flows for about 2,850 kilometres through ten countries, among them Austria, Slovakia, Hungary, "
          "Croatia, Serbia, Romania and Bulgaria, before it empties into the Black Sea through a wide delta.")
RHINE = ("The Rhine begins in the Swiss Alps, crosses Lake Constance and turns north at Basel. Below Mainz it "
         "cuts through the Rhine Gorge, where castles stand above vineyards on steep slopes, and it reaches the "
         "North Sea in the Netherlands after carrying barges loaded with coal, grain and containers.")
DELTA = ("The Danube Delta is the second-largest river delta in Europe and the best preserved. More than three "
         "hundred species of birds nest in its reed beds, lakes and channels, and the fishermen of its villages "
         "still travel mostly by boat, because few roads cross the wetland between the river's three arms.")
ALPS = ("The Alps stretch about 1,200 kilometres across eight countries, from France in the west to Slovenia in "
        "the east. Mont Blanc, on the border between France and Italy, is their highest summit at 4,806 metres, "
        "and glaciers in their valleys feed the Rhine, the Rhone, the Po and many tributaries of the Danube.")
SECRET = "This private page must never be fetched because robots.txt forbids the whole /private/ directory."


def page(title: str, body: str) -> bytes:
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title} - Geo Notes</title>
<meta name="description" content="Notes on European geography"></head>
<body>
<header><nav><a href="/">Home</a> | <a href="/articles/">Articles</a> | <a href="/about">About us</a></nav></header>
<main><article><h1>{title}</h1>
{body}
</article></main>
<aside><h3>Related</h3><ul><li><a href="/a">Lakes</a></li><li><a href="/b">Seas</a></li></ul></aside>
<footer><p>Copyright 2024 Geo Notes. All rights reserved. Cookie policy. Subscribe to our newsletter.</p></footer>
</body></html>""".encode()


PAGES = {
    "/articles/rivers.html": page("Rivers of Europe", f"<p>{DANUBE}</p>\n<h2>The Rhine</h2>\n<p>{RHINE}</p>"),
    "/articles/danube.html": page("The Danube", f"<p>{DANUBE}</p>\n<h2>The delta</h2>\n<p>{DELTA}</p>"),
    "/articles/alps.html": page("The Alps", f"<p>{ALPS}</p>"),
    "/private/secret.html": page("Secret", f"<p>{SECRET} {SECRET}</p>"),
}
NOTES_MD = f"# Field notes\n\nSome words.\n\n## Glaciers\n\n{ALPS}\n\n```\ncode block\n```\n".encode()


class Site:
    """The server's address and what it was asked for."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.searches: list[dict] = []
        self.release = threading.Event()  # set at teardown so the slow page's thread ends
        self.flaky_left = 1
        self.lock = threading.Lock()
        self.base = ""

    def url(self, path: str) -> str:
        return self.base + path

    def search_results(self) -> list[dict]:
        return [{"position": 1, "title": "Rivers of Europe", "link": self.url("/articles/rivers.html"),
                 "domain": "127.0.0.1", "snippet": "The Danube..."},
                {"position": 2, "title": "Elsewhere", "link": "http://elsewhere.invalid/rivers", "snippet": ""},
                {"position": 3, "title": "The Danube", "link": self.url("/articles/danube.html"), "snippet": ""},
                {"position": 4, "title": "Secret", "link": self.url("/private/secret.html"), "snippet": ""}]


def make_handler(site: Site):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:  # quiet
            pass

        def send(self, status: int, body: bytes, ctype: str, *, length: bool = True) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            if length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            parts = urlsplit(self.path)
            with site.lock:
                site.requests.append(parts.path)
            if parts.path == "/robots.txt":
                return self.send(200, b"User-agent: *\nDisallow: /private/\n", "text/plain")
            if parts.path == "/sitemap.xml":
                urls = ["/articles/rivers.html", "/articles/danube.html", "/articles/alps.html", "/articles/rivers.html#top",
                        "/private/secret.html", "/slow.html", "/huge.html", "/missing.html", "/notes.md", "/logo.png"]
                xml = ('<?xml version="1.0" encoding="UTF-8"?>\n<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
                       + "".join(f"<url><loc>{site.url(u)}</loc><lastmod>2024-05-01</lastmod></url>" for u in urls)
                       + "</urlset>")
                return self.send(200, xml.encode(), "application/xml")
            if parts.path == "/sitemap-index.xml.gz":  # a gzipped sitemap index pointing at the sitemap
                xml = ('<?xml version="1.0"?><sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
                       f'<sitemap><loc>{site.url("/sitemap.xml")}</loc></sitemap></sitemapindex>')
                return self.send(200, gzip.compress(xml.encode()), "application/x-gzip")
            if parts.path.startswith("/go/"):  # /go/PATH redirects to /PATH
                self.send_response(302)
                self.send_header("Location", "/" + parts.path[len("/go/"):])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if parts.path in PAGES:
                return self.send(200, PAGES[parts.path], "text/html; charset=utf-8")
            if parts.path == "/notes.md":
                return self.send(200, NOTES_MD, "text/markdown; charset=utf-8")
            if parts.path == "/logo.png":
                return self.send(200, b"\x89PNG\r\n\x1a\n" + bytes(100), "image/png")
            if parts.path == "/slow.html":
                site.release.wait(30)
                return self.send(200, PAGES["/articles/alps.html"], "text/html")
            if parts.path == "/huge.html":  # no Content-Length: the cap must stop the reading
                body = page("Huge", "<p>" + "All work and no play. " * 20000 + "</p>")
                return self.send(200, body, "text/html", length=False)
            if parts.path == "/flaky.html":
                with site.lock:
                    fail, site.flaky_left = site.flaky_left > 0, site.flaky_left - 1
                if fail:
                    self.send_response(503)
                    self.send_header("Retry-After", "0")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                return self.send(200, PAGES["/articles/alps.html"], "text/html")
            if parts.path == "/search":
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                with site.lock:
                    site.searches.append(query)
                if query.get("api_key") != "test-key":
                    return self.send(401, json.dumps({"request_info": {"success": False,
                                                                       "message": "Invalid API key"}}).encode(),
                                     "application/json")
                answer = {"request_info": {"success": True}, "search_parameters": {"q": query.get("q")},
                          "organic_results": site.search_results()}
                return self.send(200, json.dumps(answer).encode(), "application/json")
            self.send(404, b"<html><body><p>Not found</p></body></html>", "text/html")

    return Handler


@pytest.fixture
def site():
    state = Site()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    server.daemon_threads = True
    state.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="session")
def tiny_model_dir():
    from agent.train.tiny import tiny_model

    return tiny_model()
