"""A small website about one topic (the great rivers of Europe), served on loopback by http.server in
a thread: HTML articles with navigation, sidebars and footers, an index page, a sitemap.xml and a
robots.txt that forbids /drafts/. `scripts/pipeline_demo.py` makes its dataset from it with
`infernet train data --sitemap`; nothing here leaves 127.0.0.1.

    with DemoSite() as site:
        print(site.url("/sitemap.xml"))
"""

from __future__ import annotations

import threading
from html import escape
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# (path, title, [(heading, paragraph), ...]): each section is one passage of the dataset
ARTICLES: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("/rivers/danube.html", "The Danube", [
        ("Course", "The Danube is Europe's second-longest river after the Volga. It rises in the Black Forest of "
                   "Germany, at Donaueschingen, and flows for about 2,850 kilometres to the east and south-east "
                   "through ten countries, more than any other river in the world."),
        ("Capitals", "Four capital cities stand on its banks: Vienna, Bratislava, Budapest and Belgrade. In Budapest "
                     "the river divides the hills of Buda from the flat streets of Pest, and eight bridges join the "
                     "two halves of the city, the oldest of them the Chain Bridge of 1849."),
        ("The Iron Gates", "Between Serbia and Romania the Danube forces its way through the Carpathians in a gorge "
                           "called the Iron Gates. Two dams built there in 1972 and 1984 raised the water by tens of "
                           "metres, drowned the island of Ada Kaleh and made the old dangerous rapids navigable."),
        ("The delta", "The river empties into the Black Sea through a delta of three main arms, the Chilia, the "
                      "Sulina and the St. George. The delta is the best preserved in Europe: more than three hundred "
                      "species of birds nest in its reed beds, and its villages are reached mostly by boat."),
    ]),
    ("/rivers/rhine.html", "The Rhine", [
        ("Source and lakes", "The Rhine begins in the Swiss Alps, where the Anterior Rhine and the Posterior Rhine "
                             "meet near Reichenau. It flows through Lake Constance, drops over the Rhine Falls at "
                             "Schaffhausen, the largest plain waterfall in Europe, and turns north at Basel."),
        ("The Rhine Gorge", "Below Bingen the river cuts through the Rhine Gorge, a stretch of sixty-five kilometres "
                            "where castles stand above vineyards on steep slate slopes. The Lorelei rock, 132 metres "
                            "high, marks the narrowest and deepest point, feared by boatmen for centuries."),
        ("Shipping", "The Rhine is the busiest inland waterway in Europe. Barges carry coal, grain, chemicals and "
                     "containers between Basel and Rotterdam, whose port at the river's mouth is the largest in "
                     "Europe; the Mannheim Act of 1868 still guarantees free navigation on the river."),
    ]),
    ("/rivers/rhone.html", "The Rhone", [
        ("The glacier", "The Rhone is born from the Rhone Glacier in the Swiss canton of Valais, at about 2,200 "
                        "metres. It runs west through the Valais valley, fills Lake Geneva from the east and leaves "
                        "it at Geneva, where the clear Rhone meets the grey, silty waters of the Arve."),
        ("Lyon", "At Lyon the Rhone is joined by the Saone, and the old town of the silk weavers lies on the "
                 "peninsula between the two rivers. From there the Rhone flows due south, between the Massif "
                 "Central and the Alps, past the vineyards of the Cotes du Rhone and the bridge of Avignon."),
        ("The Camargue", "Below Arles the river splits into the Great Rhone and the Little Rhone, which enclose the "
                         "Camargue, a wetland of salt marshes and lagoons. White horses, black bulls and flocks of "
                         "pink flamingos live there, and salt is still harvested from shallow pans near the sea."),
    ]),
    ("/rivers/elbe.html", "The Elbe", [
        ("Bohemia", "The Elbe rises in the Giant Mountains on the border between the Czech Republic and Poland. In "
                    "Bohemia it is called the Labe; it receives the Vltava, the river of Prague, at Melnik, and "
                    "leaves the country through a sandstone gorge known as Bohemian and Saxon Switzerland."),
        ("Dresden", "In Saxony the Elbe passes Dresden, whose baroque churches and palaces line its southern bank. "
                    "The wide meadows along the river are left unbuilt on purpose, because the Elbe floods often: "
                    "in August 2002 the water rose to more than nine metres above its normal level."),
        ("Hamburg", "The river reaches the North Sea at Cuxhaven, about a hundred kilometres below Hamburg. The "
                    "tide is felt far upstream, and ocean-going container ships sail up the dredged channel to "
                    "the port of Hamburg, the third busiest in Europe after Rotterdam and Antwerp."),
    ]),
    ("/rivers/volga.html", "The Volga", [
        ("Length", "The Volga is the longest river in Europe, about 3,530 kilometres from the Valdai Hills north-west "
                   "of Moscow to the Caspian Sea. Its basin covers much of European Russia, and about half of the "
                   "country's people live within it, in cities such as Nizhny Novgorod, Kazan and Samara."),
        ("Reservoirs", "A chain of dams built in the twentieth century turned most of the Volga into a staircase of "
                       "reservoirs. The Kuybyshev Reservoir near Samara is the largest in Europe by area, and the "
                       "locks beside each dam let river cruise ships travel from Moscow to Astrakhan."),
        ("The delta", "Below Astrakhan the Volga spreads into a delta of more than five hundred channels before it "
                      "reaches the Caspian Sea, a lake with no outlet to the ocean. The delta is home to sturgeon, "
                      "pelicans and lotus flowers, and its fisheries once supplied most of the world's caviar."),
    ]),
]
DRAFT = ("This draft is not finished and must never be fetched: robots.txt forbids the whole /drafts/ directory, "
         "and a polite crawler obeys it.")


def page(title: str, body: str) -> bytes:
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)} - River Notes</title>
<meta name="description" content="Notes on the great rivers of Europe"></head>
<body>
<header><nav><a href="/">Home</a> | <a href="/rivers/">Rivers</a> | <a href="/about.html">About us</a></nav></header>
<main><article><h1>{escape(title)}</h1>
{body}
</article></main>
<aside><h3>Related</h3><ul><li><a href="/rivers/danube.html">Danube</a></li><li><a href="/rivers/rhine.html">Rhine</a></li></ul></aside>
<footer><p>Copyright 2025 River Notes. All rights reserved. Cookie policy. Subscribe to our newsletter.</p></footer>
</body></html>""".encode()


def pages() -> dict[str, bytes]:
    out = {path: page(title, "\n".join(f"<h2>{escape(h)}</h2>\n<p>{escape(p)}</p>" for h, p in sections))
           for path, title, sections in ARTICLES}
    out["/"] = page("River Notes", "<p>Short notes on the great rivers of Europe.</p><ul>" + "".join(
        f'<li><a href="{path}">{escape(title)}</a></li>' for path, title, _ in ARTICLES) + "</ul>")
    out["/drafts/oder.html"] = page("The Oder (draft)", f"<p>{DRAFT} {DRAFT}</p>")
    return out


class DemoSite:
    """The site on 127.0.0.1 (a free port) while the ``with`` block runs; ``requests`` lists the paths asked for."""

    def __init__(self) -> None:
        self.pages = pages()
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.base = ""
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def url(self, path: str) -> str:
        return self.base + path

    def sitemap(self) -> bytes:
        paths = [path for path, _, _ in ARTICLES] + ["/", "/drafts/oder.html"]
        return ('<?xml version="1.0" encoding="UTF-8"?>\n'
                '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">\n'
                + "".join(f"  <url><loc>{self.url(p)}</loc><lastmod>2025-03-01</lastmod></url>\n" for p in paths)
                + "</urlset>\n").encode()

    def __enter__(self) -> "DemoSite":
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:  # quiet
                pass

            def send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0].split("#", 1)[0]
                with site.lock:
                    site.requests.append(path)
                if path == "/robots.txt":
                    return self.send(200, b"User-agent: *\nDisallow: /drafts/\n", "text/plain")
                if path == "/sitemap.xml":
                    return self.send(200, site.sitemap(), "application/xml")
                if path in site.pages:
                    return self.send(200, site.pages[path], "text/html; charset=utf-8")
                self.send(404, b"<html><body><p>Not found</p></body></html>", "text/html")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
