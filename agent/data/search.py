"""Web search providers for ``infernet train data --query``: a query in, result URLs out.

Rules of this file:
- A provider is a small class with one job (``SearchProvider``): ``search(query, domains, num)``
  returns at most ``num`` results, in the provider's order, each URL once, only from ``domains``
  when some are given (``site:`` terms go into the query, and results are filtered again here).
  Add one by writing a class and naming it in ``PROVIDERS``.
- ValueSerp: ``GET {endpoint}?api_key=..&q=..&num=..&page=..``, JSON with ``organic_results:
  [{link, title, snippet, ...}]``; at most 100 results a page. The endpoint can be moved
  (``--search-endpoint`` or ``INFERNET_SEARCH_ENDPOINT``), which is how tests reach a loopback server.
- The API key comes from the environment (``VALUESERP_API_KEY``), else from the ``[search]`` table
  of the agent's config.toml (``valueserp_api_key``). It is never printed: errors name the endpoint
  without its query string.
- Every failure is one ``DataSourceError`` line: no key, unreachable, refused key, not the JSON shape.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence
from urllib.parse import urlencode, urlsplit

from agent.data import DataSourceError
from agent.data.http import FetchFailed, http_get

ENDPOINT_ENV = "INFERNET_SEARCH_ENDPOINT"
MAX_RESPONSE_BYTES = 4 << 20


@dataclass(frozen=True)
class SearchResult:
    url: str
    title: str = ""
    snippet: str = ""


class SearchProvider(Protocol):
    name: str

    def search(self, query: str, *, domains: Sequence[str], num: int) -> list[SearchResult]: ...


def host_in(url: str, domains: Sequence[str]) -> bool:
    """Whether ``url``'s host is one of ``domains`` or below one (``docs.x.org`` is in ``x.org``)."""
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in (d.lower().strip(".") for d in domains))


def site_query(query: str, domains: Sequence[str]) -> str:
    if not domains:
        return query
    sites = " OR ".join(f"site:{d}" for d in domains)
    return f"{query} ({sites})" if len(domains) > 1 else f"{query} {sites}"


class ValueSerp:
    """ValueSerp's Google search API (https://www.valueserp.com/docs)."""

    name = "valueserp"
    DEFAULT_ENDPOINT = "https://api.valueserp.com/search"
    KEY_ENV = "VALUESERP_API_KEY"
    CONFIG_KEY = "valueserp_api_key"
    PAGE_SIZE = 100

    def __init__(self, api_key: str, endpoint: str | None = None, timeout: float = 30.0) -> None:
        self.api_key = api_key
        self.endpoint = endpoint or self.DEFAULT_ENDPOINT
        self.timeout = timeout

    def search(self, query: str, *, domains: Sequence[str], num: int) -> list[SearchResult]:
        results: list[SearchResult] = []
        seen: set[str] = set()
        page = 1
        while len(results) < num and page <= 10:
            organic = self._page(site_query(query, domains), min(self.PAGE_SIZE, num), page)
            fresh = 0
            for item in organic:
                link = item.get("link") if isinstance(item, dict) else None
                if not isinstance(link, str) or link in seen or (domains and not host_in(link, domains)):
                    continue
                seen.add(link)
                fresh += 1
                results.append(SearchResult(link, str(item.get("title") or ""), str(item.get("snippet") or "")))
                if len(results) == num:
                    break
            if fresh == 0 or len(organic) < min(self.PAGE_SIZE, num):  # nothing new, or the last page
                break
            page += 1
        return results

    def _page(self, q: str, num: int, page: int) -> list:
        params = {"api_key": self.api_key, "q": q, "num": num, "output": "json"}
        if page > 1:
            params["page"] = page
        where = f"{self.name} at {self.endpoint}"
        try:
            response = http_get(f"{self.endpoint}?{urlencode(params)}", timeout=self.timeout,
                                max_bytes=MAX_RESPONSE_BYTES, headers={"Accept": "application/json"})
        except FetchFailed as error:
            raise DataSourceError(f"search provider {where}: {error}") from None
        if response.status in (401, 403):
            raise DataSourceError(f"search provider {where} refused the API key (HTTP {response.status}): "
                                  f"check {self.KEY_ENV}")
        try:
            answer = json.loads(response.body.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            answer = None
        if response.status != 200:
            message = answer.get("request_info", {}).get("message") if isinstance(answer, dict) else None
            raise DataSourceError(f"search provider {where} answered HTTP {response.status}"
                                  + (f": {message}" if isinstance(message, str) else ""))
        if not isinstance(answer, dict):
            raise DataSourceError(f"search provider {where} answered something that is not JSON")
        info = answer.get("request_info")
        if isinstance(info, dict) and info.get("success") is False:
            raise DataSourceError(f"search provider {where}: {info.get('message') or 'request failed'}")
        organic = answer.get("organic_results", [])
        if not isinstance(organic, list):
            raise DataSourceError(f"search provider {where}: organic_results is not a list")
        return organic


PROVIDERS = {"valueserp": ValueSerp}


def search_config(home: Path) -> dict:
    """The ``[search]`` table of the agent's config.toml ({} when there is none)."""
    path = home / "config.toml"
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8")).get("search", {})
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise DataSourceError(f"{path}: not a readable TOML config: {error}") from None
    if not isinstance(table, dict):
        raise DataSourceError(f"{path}: [search] must be a table")
    return table


def make_provider(name: str, home: Path, endpoint: str | None = None, timeout: float = 30.0) -> SearchProvider:
    """The named provider with its key (environment first, then config.toml) and endpoint."""
    cls = PROVIDERS.get(name)
    if cls is None:
        raise DataSourceError(f"unknown search provider {name!r} (known: {', '.join(PROVIDERS)})")
    key = os.environ.get(cls.KEY_ENV, "").strip()
    if not key:
        value = search_config(home).get(cls.CONFIG_KEY)
        key = value.strip() if isinstance(value, str) else ""
    if not key:
        raise DataSourceError(f"no {name} API key: set {cls.KEY_ENV}, or {cls.CONFIG_KEY} under [search] in "
                              f"{home / 'config.toml'} (or give --urls, --sitemap or --dir instead of --query)")
    return cls(key, endpoint or os.environ.get(ENDPOINT_ENV) or None, timeout)
