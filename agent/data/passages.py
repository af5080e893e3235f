"""Readable text out of a page or a file, cut into passages, made into ChatML records.

Rules of this file:
- HTML goes through trafilatura (boilerplate, navigation and footers removed); its XML output gives
  the blocks (paragraphs, lists, tables, quotes, code) and the headings above them. Markdown is split
  at blank lines, ``#`` lines being headings and fenced code kept whole; plain text at blank lines.
  No I/O here: bytes in, blocks out.
- ``chunk`` joins consecutive blocks (blank line between) into passages of ``min_chars`` to
  ``max_chars`` characters: a passage ends before the block that would take it over ``max_chars``,
  or at a new heading once it is long enough. A block longer than ``max_chars`` is cut at sentence
  ends (at spaces if a sentence is longer still). A passage left shorter than ``min_chars`` joins the
  one before when it fits, else is dropped (counted).
- A record is a question-style user turn naming the page (and the heading) and the passage as the
  assistant turn; ``meta`` holds ``source_url``, ``paragraph_index`` (the passage's 0-based index in
  its page) and ``title``. The question is a template: the passage is the knowledge, the user turn
  only points at it.
- ``text_key`` is what duplicates are judged by: case-folded, whitespace collapsed.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
MARKDOWN_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    text: str
    heading: str | None = None


@dataclass(frozen=True)
class Passage:
    text: str
    heading: str | None


@dataclass
class Extracted:
    title: str | None
    blocks: list[Block]


def _clean(text: str) -> str:
    return re.sub(r"[ \t\r\f\v]+", " ", text).strip()


def html_blocks(html: bytes | str, url: str | None = None) -> Extracted:
    """The readable blocks of an HTML page (trafilatura), each with the heading it sits under."""
    try:
        import trafilatura
        from lxml import etree
    except ImportError:
        from agent.data import DataSourceError

        raise DataSourceError("reading HTML needs trafilatura: pip install 'infernet-agent[data]' "
                              "(make setup installs it)") from None

    xml = trafilatura.extract(html, url=url, output_format="xml", with_metadata=True, include_comments=False,
                              include_tables=True, include_images=False, include_links=False, deduplicate=False)
    if not xml:
        return Extracted(None, [])
    root = etree.fromstring(xml.encode("utf-8"), etree.XMLParser(resolve_entities=False, no_network=True))
    title = _clean(root.get("title") or "") or None
    main = root.find("main")
    blocks: list[Block] = []
    heading: str | None = None
    for element in (main if main is not None else []):
        if element.tag == "head":
            heading = _clean("".join(element.itertext())) or heading
            continue
        if element.tag == "list":
            items = [_clean("".join(item.itertext())) for item in element.iter("item")]
            text = "\n".join(f"- {item}" for item in items if item)
        elif element.tag == "table":
            rows = [" | ".join(_clean("".join(cell.itertext())) for cell in row.iter("cell"))
                    for row in element.iter("row")]
            text = "\n".join(row for row in rows if row.strip(" |"))
        elif element.tag == "code":
            text = "".join(element.itertext()).strip("\n")
        else:  # p, quote, and whatever else trafilatura keeps
            text = _clean("".join(element.itertext()))
        if text.strip():
            blocks.append(Block(text, heading))
    return Extracted(title, blocks)


def markdown_blocks(text: str) -> Extracted:
    """Blocks of a Markdown text: paragraphs at blank lines, ``#`` headings, fenced code kept whole."""
    blocks: list[Block] = []
    heading: str | None = None
    title: str | None = None
    lines: list[str] = []
    fence: str | None = None

    def flush() -> None:
        body = "\n".join(lines).strip("\n")
        if body.strip():
            blocks.append(Block(body, heading))
        lines.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if fence is not None:
            lines.append(line)
            if stripped.startswith(fence):
                fence = None
                flush()
            continue
        if stripped.startswith(("```", "~~~")):
            flush()
            fence = stripped[:3]
            lines.append(line)
            continue
        match = MARKDOWN_HEADING.match(line)
        if match:
            flush()
            heading = _clean(match.group(2)) or heading
            if title is None and len(match.group(1)) == 1:
                title = heading
            continue
        if not stripped:
            flush()
            continue
        lines.append(line.rstrip())
    flush()
    return Extracted(title, blocks)


def text_blocks(text: str) -> Extracted:
    """Blocks of plain text: paragraphs at blank lines."""
    paragraphs = re.split(r"\n\s*\n", text.replace("\r\n", "\n"))
    return Extracted(None, [Block(p.strip("\n")) for p in paragraphs if p.strip()])


def _split_long(text: str, max_chars: int) -> list[str]:
    """Cut a block longer than ``max_chars`` at sentence ends, at spaces where a sentence is longer."""
    pieces: list[str] = []
    current = ""
    for sentence in SENTENCE_END.split(text):
        while len(sentence) > max_chars:  # one sentence longer than a passage: cut at the last space
            cut = sentence.rfind(" ", 0, max_chars + 1)
            cut = cut if cut > 0 else max_chars
            if current:
                pieces.append(current)
                current = ""
            pieces.append(sentence[:cut].rstrip())
            sentence = sentence[cut:].lstrip()
        if current and len(current) + 1 + len(sentence) > max_chars:
            pieces.append(current)
            current = ""
        current = f"{current} {sentence}" if current else sentence
    if current:
        pieces.append(current)
    return [p for p in pieces if p.strip()]


def chunk(blocks: Sequence[Block], min_chars: int, max_chars: int) -> tuple[list[Passage], int]:
    """Passages of ``min_chars``..``max_chars`` characters, and how many short ones were dropped."""
    if not 0 < min_chars <= max_chars:
        raise ValueError("need 0 < min_chars <= max_chars")
    pieces: list[Block] = []
    for block in blocks:
        if len(block.text) > max_chars:
            pieces.extend(Block(piece, block.heading) for piece in _split_long(block.text, max_chars))
        else:
            pieces.append(block)
    passages: list[Passage] = []
    dropped = 0
    text, heading = "", None

    def close() -> None:
        nonlocal dropped
        if not text:
            return
        if len(text) >= min_chars:
            passages.append(Passage(text, heading))
        elif passages and len(passages[-1].text) + 2 + len(text) <= max_chars:
            passages[-1] = Passage(passages[-1].text + "\n\n" + text, passages[-1].heading)
        else:
            dropped += 1

    for piece in pieces:
        new_heading = piece.heading != heading and len(text) >= min_chars
        if text and (len(text) + 2 + len(piece.text) > max_chars or new_heading):
            close()
            text = ""
        if not text:
            heading = piece.heading
        text = f"{text}\n\n{piece.text}" if text else piece.text
    close()
    return passages, dropped


def question(title: str | None, heading: str | None, source: str) -> str:
    """The user turn that asks for a passage."""
    subject = title or source
    if heading and heading.casefold() != (title or "").casefold():
        return f'What does "{subject}" say about {heading}?'
    return f'What does "{subject}" say?'


def make_records(passages: Iterable[Passage], *, title: str | None, source_url: str, source: str) -> list[dict]:
    """ChatML records for a page's passages, ``meta.paragraph_index`` counting from 0."""
    return [{"messages": [{"role": "user", "content": question(title, p.heading, source)},
                          {"role": "assistant", "content": p.text}],
             "meta": {"source_url": source_url, "paragraph_index": index, "title": title}}
            for index, p in enumerate(passages)]


def text_key(text: str) -> bytes:
    """What two passages must share to be duplicates: the text case-folded, whitespace collapsed."""
    return hashlib.sha256(" ".join(text.casefold().split()).encode("utf-8")).digest()
