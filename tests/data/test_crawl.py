"""`infernet train data` against a real HTTP server on loopback (tests/data/conftest.py)."""

from __future__ import annotations

import json
import socket

import pytest

from agent.data.crawl import FetchPolicy, PoliteFetcher, Skipped
from agent.data.http import FetchFailed, http_get
from agent.data.passages import Block, chunk, html_blocks, markdown_blocks
from agent.train.data import check_dataset, read_chatml
from tests.cli.conftest import assert_one_line_error, cli
from tests.data.conftest import ALPS, DANUBE, DELTA, PAGES, RHINE

FAST = ("--delay", "0", "--timeout", "2", "--retries", "0", "--max-bytes", "200000")


def assistant_texts(path):
    return [r.messages[-1]["content"] for r in read_chatml(path).records]


def test_sitemap_crawl_obeys_robots_caps_and_dedupes(site, tmp_path):
    out = tmp_path / "rivers.jsonl"
    done = cli("train", "data", "--sitemap", site.url("/sitemap.xml"), "--out", str(out), "--json", *FAST, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress bar when stderr is not a terminal
    report = json.loads(done.stdout)
    reasons = {url.rsplit("/", 1)[-1]: reason for url, reason in ((s["url"], s["reason"]) for s in report["skipped"])}
    assert reasons["secret.html"] == "robots.txt disallows"
    assert reasons["slow.html"].startswith("timeout")
    assert reasons["huge.html"].startswith("too large")
    assert reasons["missing.html"] == "HTTP 404"
    assert reasons["logo.png"].startswith("not text")
    assert report["documents"] == 9  # rivers.html#top is rivers.html
    assert report["duplicates_dropped"] == 1  # the Danube paragraph is on two pages
    assert "/private/secret.html" not in site.requests  # robots.txt obeyed: never asked for
    assert site.requests.count("/robots.txt") == 1 and site.requests.count("/articles/rivers.html") == 1

    data = check_dataset(out, 1, 0.0, 0)  # what a job accepts
    texts = [r.messages[-1]["content"] for r in data.records]
    assert report["records"] == len(texts) == 5
    for text in (DANUBE, RHINE, DELTA, ALPS):
        assert sum(text in t for t in texts) == (2 if text == ALPS else 1), text  # alps page + notes.md
    joined = "\n".join(texts)
    assert "Cookie policy" not in joined and "About us" not in joined and "Secret" not in joined
    assert all(200 <= len(t) <= 4000 for t in texts)
    for record in data.records:
        user, assistant = record.messages
        assert user["role"] == "user" and user["content"].startswith("What does ") and user["content"].endswith("?")
        assert record.meta["source_url"].startswith(site.base) and isinstance(record.meta["paragraph_index"], int)
    rhine = next(r for r in data.records if RHINE in r.messages[1]["content"])
    assert rhine.meta == {"source_url": site.url("/articles/rivers.html"), "paragraph_index": 1,
                          "title": "Rivers of Europe"}
    assert rhine.messages[0]["content"] == 'What does "Rivers of Europe" say about The Rhine?'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rivers.jsonl"]  # no temp file left behind


def test_text_summary_redirects_and_a_gzipped_sitemap_index(site, tmp_path):
    urls = tmp_path / "urls.txt"
    urls.write_text(f"# three pages\n{site.url('/go/articles/alps.html')}\n\n{site.url('/missing.html')}\n"
                    f"{site.url('/go/private/secret.html')}\n")
    out = tmp_path / "alps.jsonl"
    done = cli("train", "data", "--urls", str(urls), "--out", str(out), *FAST, check=True)
    assert "wrote 1 records" in done.stdout and "1 HTTP 404" in done.stdout
    assert f"{site.url('/missing.html')}: HTTP 404" in done.stdout
    assert f"robots.txt disallows (redirected to {site.url('/private/secret.html')})" in done.stdout
    assert "/private/secret.html" not in site.requests  # the redirect's target is checked before it is asked for
    assert [r.meta["source_url"] for r in read_chatml(out).records] == [site.url("/articles/alps.html")]

    indexed = tmp_path / "indexed.jsonl"
    report = json.loads(cli("train", "data", "--sitemap", site.url("/sitemap-index.xml.gz"), "--num", "3",
                            "--out", str(indexed), "--json", *FAST, check=True).stdout)
    assert report["documents"] == 3 and report["records"] == 4  # rivers (2), danube (delta; its Danube is a dup), alps


def test_search_through_valueserp_shape(site, tmp_path, monkeypatch):
    out = tmp_path / "search.jsonl"
    done = cli("train", "data", "--query", "european rivers", "--domains", "127.0.0.1", "--num", "5",
               "--search-endpoint", site.url("/search"), "--out", str(out), "--home", str(tmp_path / "home"),
               "--json", *FAST, env={"VALUESERP_API_KEY": "test-key"})
    assert done.returncode == 0, done.stderr
    assert site.searches[0]["q"] == "european rivers site:127.0.0.1" and site.searches[0]["num"] == "5"
    report = json.loads(done.stdout)
    assert report["documents"] == 3  # elsewhere.invalid is not on the domain
    assert [s["reason"] for s in report["skipped"]] == ["robots.txt disallows"]
    texts = assistant_texts(out)
    assert len(texts) == 3 and DELTA in texts and RHINE in texts
    assert "test-key" not in done.stdout + done.stderr


def test_search_key_from_config_and_the_agent_still_loads_it(site, tmp_path):
    from agent.config import ConfigError, load_config

    home = tmp_path / "home"
    cli("agent", "init", "--home", str(home), check=True)
    config = home / "config.toml"
    with_key = config.read_text() + '\n[search]\nvalueserp_api_key = "test-key"\n'
    config.write_text(with_key)
    assert load_config(home).threads == 1  # [search] is not an agent key, and not an error
    (home / "config.toml").write_text('search = "key"\n')
    with pytest.raises(ConfigError, match="search: expected a table"):
        load_config(home)
    config.write_text(with_key)
    out = tmp_path / "search.jsonl"
    done = cli("train", "data", "--query", "rivers", "--domains", "127.0.0.1", "--num", "1", "--out", str(out),
               "--home", str(home), *FAST, env={"VALUESERP_API_KEY": "", "INFERNET_SEARCH_ENDPOINT": site.url("/search")})
    assert done.returncode == 0, done.stderr
    assert len(site.searches) == 1 and assistant_texts(out) == [DANUBE, RHINE]


def test_one_line_errors(site, tmp_path):
    home = str(tmp_path / "home")
    out = str(tmp_path / "out.jsonl")
    no_key = cli("train", "data", "--query", "rivers", "--out", out, "--home", home, env={"VALUESERP_API_KEY": ""})
    assert_one_line_error(no_key, "no valueserp API key", "VALUESERP_API_KEY")
    bad_key = cli("train", "data", "--query", "rivers", "--out", out, "--home", home, "--search-endpoint",
                  site.url("/search"), env={"VALUESERP_API_KEY": "wrong-key"})
    assert_one_line_error(bad_key, "refused the API key (HTTP 401)")
    assert "wrong-key" not in bad_key.stderr

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    unreachable = cli("train", "data", "--sitemap", f"http://127.0.0.1:{closed}/sitemap.xml", "--out", out, *FAST)
    assert_one_line_error(unreachable, f"127.0.0.1:{closed}/sitemap.xml", "unreachable")
    search_down = cli("train", "data", "--query", "x", "--out", out, "--search-endpoint",
                      f"http://127.0.0.1:{closed}/search", *FAST, env={"VALUESERP_API_KEY": "k"})
    assert_one_line_error(search_down, "search provider", "unreachable")

    before = len(site.requests)
    missing_dir = cli("train", "data", "--sitemap", site.url("/sitemap.xml"), "--out", str(tmp_path / "no" / "x.jsonl"))
    assert_one_line_error(missing_dir, "does not exist")
    is_dir = cli("train", "data", "--sitemap", site.url("/sitemap.xml"), "--out", str(tmp_path))
    assert_one_line_error(is_dir, "is a directory")
    assert len(site.requests) == before  # the output is checked before any request

    urls = tmp_path / "urls.txt"
    urls.write_text(f"{site.url('/a')}\nftp://example.org/file\n")
    assert_one_line_error(cli("train", "data", "--urls", str(urls), "--out", out), f"{urls}:2", "not an http(s) URL")
    only_missing = tmp_path / "missing.txt"
    only_missing.write_text(site.url("/missing.html") + "\n")
    nothing = cli("train", "data", "--urls", str(only_missing), "--out", out, *FAST)
    assert_one_line_error(nothing, "no records", "1 HTTP 404")
    assert not (tmp_path / "out.jsonl").exists()
    assert_one_line_error(cli("train", "data", "--out", out), "no source")


def test_local_directory(tmp_path):
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (docs / "guide" / "alps.md").write_text(f"# The Alps\n\n{ALPS}\n")
    (docs / "rivers.html").write_bytes(PAGES["/articles/rivers.html"])
    (docs / "delta.txt").write_text(f"{DELTA}\n\nshort\n")
    (docs / "image.png").write_bytes(b"\x89PNG")
    (docs / ".hidden.md").write_text(DANUBE)
    out = tmp_path / "local.jsonl"
    cli("train", "data", "--dir", str(docs), "--out", str(out), check=True)
    records = read_chatml(out).records
    assert [(r.meta["source_url"], r.meta["paragraph_index"]) for r in records] == [
        ("delta.txt", 0), ("guide/alps.md", 0), ("rivers.html", 0), ("rivers.html", 1)]
    assert records[1].messages[0]["content"] == 'What does "The Alps" say?'
    assert records[0].messages[1]["content"] == DELTA + "\n\nshort"  # a short tail joins the passage before


# -- the parts, in process ---------------------------------------------------------------------------------

def test_chunk_keeps_passages_within_bounds():
    sentence = "The river runs past the old mill and under the stone bridge. "
    blocks = [Block("Intro line.", None), Block(sentence * 10, "A"), Block(sentence * 200, "B"), Block("x" * 9000, "C")]
    passages, dropped = chunk(blocks, 200, 1000)
    assert all(200 <= len(p.text) <= 1000 for p in passages), [len(p.text) for p in passages]
    assert passages[0].text.startswith("Intro line.") and passages[0].heading is None  # a short head joins on
    assert {p.heading for p in passages} == {None, "B", "C"} and dropped == 0
    assert "".join(p.text for p in passages if p.heading == "C") == "x" * 9000  # no space: cut hard
    _, dropped = chunk([Block("tiny")], 200, 1000)
    assert dropped == 1


def test_extraction_drops_boilerplate_and_keeps_headings():
    extracted = html_blocks(PAGES["/articles/rivers.html"])
    assert extracted.title == "Rivers of Europe"
    assert [(b.heading, b.text) for b in extracted.blocks] == [("Rivers of Europe", DANUBE), ("The Rhine", RHINE)]
    md = markdown_blocks("# T\n\npara one\nstill one\n\n## H\n```\na\n\nb\n```\n")
    assert md.title == "T" and [(b.heading, b.text) for b in md.blocks] == [("T", "para one\nstill one"),
                                                                           ("H", "```\na\n\nb\n```")]


def test_retries_and_per_host_delay(site):
    sleeps: list[float] = []
    now = [0.0]
    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    fetcher = PoliteFetcher(FetchPolicy(timeout=5, retries=1, delay=3.0), sleep=sleep, clock=lambda: now[0])
    assert fetcher.get(site.url("/flaky.html")).status == 200  # 503 with Retry-After: 0, then 200
    assert site.requests == ["/robots.txt", "/flaky.html", "/flaky.html"]
    assert sleeps == [3.0, 0, 3.0]  # the host's delay before each request; Retry-After 0 between the tries
    try:
        fetcher.get(site.url("/missing.html"))
    except Skipped as skipped:
        assert skipped.reason == "HTTP 404"  # a 404 is not tried again
    assert site.requests.count("/missing.html") == 1


def test_http_get_caps_a_declared_length_before_reading(site):
    try:
        http_get(site.url("/articles/alps.html"), timeout=5, max_bytes=100)
    except FetchFailed as error:
        assert error.reason == "too large" and "limit 100" in error.detail
    else:
        raise AssertionError("a page over the cap was read")


def test_progress_bar_only_on_a_terminal(tmp_path):
    import os
    import pty
    import subprocess
    import sys

    from tests.cli.conftest import REPO

    (tmp_path / "alps.md").write_text(f"# The Alps\n\n{ALPS}\n")
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "agent.cli", "train", "data", "--dir", str(tmp_path),
                                "--out", str(tmp_path / "out.jsonl")], stdout=subprocess.PIPE, stderr=slave,
                               cwd=REPO, env=dict(os.environ, TERM="xterm", COLUMNS="100"))
    os.close(slave)
    stdout, _ = process.communicate(timeout=60)
    terminal = b""
    while True:
        try:
            part = os.read(master, 65536)
        except OSError:  # the other end is closed
            break
        if not part:
            break
        terminal += part
    os.close(master)
    assert process.returncode == 0 and stdout.startswith(b"wrote 1 records")
    assert b"fetching" in terminal and b"1/1" in terminal  # on stderr, the terminal; never on stdout
    assert b"fetching" not in stdout
