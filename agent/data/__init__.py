"""Making and checking datasets: ``infernet train data`` (web search, URLs, a sitemap or local files
to ChatML JSONL) and ``infernet data check``. This directory also ships the demo dataset (demo.jsonl).

- http.py: one bounded HTTP GET (whole-request deadline, size cap); no politeness of its own.
- search.py: search providers (ValueSerp), an interface so others can be added.
- crawl.py: polite fetching (robots.txt, per-host delay, retries) and the dataset builder.
- passages.py: readable text out of HTML (trafilatura), Markdown and text; chunks; ChatML records.
- check.py: validation and statistics of a ChatML file.
"""


class DataSourceError(Exception):
    """A source of a dataset cannot be used (no API key, unreachable site, unwritable output, bad URL
    list); the message is the one line to show."""
