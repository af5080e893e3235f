"""``infernet data check FILE``: is a ChatML (or preference) JSONL file what a job will accept, and what is in it.

Rules of this file:
- Lines are judged by the training reader itself (agent.train.data.read_chatml, ``skip_bad``): every
  bad line is one problem ``FILE:LINE: problem``, all of them, not only the first. A file with no
  record is a problem too. Problems make the check fail; nothing else does.
- Warnings do not fail it: a record repeating an earlier one (same messages, line of the first
  named), an assistant turn that is empty (nothing to learn from).
- Counts: records, turns (messages) and characters of content, in all and by role.
- A file of preference records (a DPO job's, agent/train/preference.py; ``--format preference``, or found
  from its first record having "chosen") is read by the preference reader; its turns are the prompt's
  and both completions', and with a tokenizer its tokens are both sides of each pair, labels the
  completions', and a pair is dropped when a cut leaves either side without a label.
- With a tokenizer (``--model``), tokens as training sees them: each record rendered with the
  model's chat template; per-record length (min, mean, median, p95, max), all tokens, assistant
  (label) tokens; with ``max_seq_len``, how many records training would cut, and how many it would
  drop because the cut leaves no assistant token (agent.train.data.tokenize's rule).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.data import DataSourceError


@dataclass
class CheckReport:
    path: str
    records: int = 0
    problems: list[str] = field(default_factory=list)
    turns: dict[str, int] = field(default_factory=dict)
    chars: dict[str, int] = field(default_factory=dict)
    duplicates: list[tuple[int, int]] = field(default_factory=list)  # (line, line of the first copy)
    empty_assistant: list[int] = field(default_factory=list)
    tokens: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"file": self.path, "ok": self.ok, "records": self.records, "problems": self.problems,
                "turns": self.turns, "chars": self.chars,
                "duplicates": [{"line": line, "first": first} for line, first in self.duplicates],
                "empty_assistant_lines": self.empty_assistant, "tokens": self.tokens}


def sniff_format(path: Path) -> str:
    """``preference`` when the file's first JSON line is an object with "chosen", else ``chatml``."""
    with open(path, "rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except (ValueError, RecursionError):
                    return "chatml"
                return "preference" if isinstance(first, dict) and "chosen" in first else "chatml"
    return "chatml"


def _messages(record: Any) -> tuple:
    return record.messages if hasattr(record, "messages") else record.prompt + record.chosen + record.rejected


def check_file(path: Path, *, tokenizer: Any = None, max_seq_len: int | None = None,
               format: str | None = None) -> CheckReport:
    """Validate ``path`` and count what is in it (see the rules at the top of this file); ``format`` None:
    ``sniff_format``."""
    from agent.train.data import read_records

    format = format or sniff_format(path)
    data = read_records(path, format, skip_bad=True)
    report = CheckReport(str(path), len(data.records), list(data.problems))
    if not data.records and not data.problems:
        report.problems.append(f"{path}: no records: the file is empty")
    turns: Counter[str] = Counter()
    chars: Counter[str] = Counter()
    first_line: dict[bytes, int] = {}
    for record in data.records:
        messages = _messages(record)
        for message in messages:
            turns[message["role"]] += 1
            chars[message["role"]] += len(message["content"])
        if any(m["role"] == "assistant" and not m["content"].strip() for m in messages):
            report.empty_assistant.append(record.line)
        key = hashlib.sha256(json.dumps(messages, sort_keys=True).encode("utf-8")).digest()
        if key in first_line:
            report.duplicates.append((record.line, first_line[key]))
        else:
            first_line[key] = record.line
    report.turns = {"total": sum(turns.values()), **{role: turns[role] for role in ("system", "user", "assistant")}}
    report.chars = {"total": sum(chars.values()), **{role: chars[role] for role in ("system", "user", "assistant")}}
    if data.records and not any(r.learnable() for r in data.records):
        # what `train run` and `job announce` refuse (agent/train/data.check_dataset): `data check` said ok
        report.problems.append(f"{path}: no assistant text to learn from: every assistant message is empty "
                               "(or there is none)")
    if tokenizer is not None and data.records:
        report.tokens = token_stats(tokenizer, data.records, max_seq_len)
    return report


def _sides(tokenizer: Any, record: Any) -> list[tuple[list[int], list[int]]]:
    """(token ids, label mask) of each sequence training makes of a record: one, or a pair's two."""
    from agent.train.data import IGNORE_INDEX, assistant_mask

    if hasattr(record, "messages"):
        return [assistant_mask(tokenizer, record.messages)]
    from agent.train.preference import PreferencePair, tokenize_pairs

    (pair,), _ = tokenize_pairs(tokenizer, [record], 1 << 30)  # whole: the cut is counted below
    assert isinstance(pair, PreferencePair)
    return [(list(e.input_ids), [int(label != IGNORE_INDEX) for label in e.labels]) for e in (pair.chosen, pair.rejected)]


def token_stats(tokenizer: Any, records: list, max_seq_len: int | None) -> dict[str, Any]:
    lengths, labels, cut, dropped = [], 0, 0, 0
    for record in records:
        sides = _sides(tokenizer, record)
        ids = [token for side, _ in sides for token in side]
        mask = [keep for _, side in sides for keep in side]
        lengths.append(len(ids))
        labels += sum(mask)
        if max_seq_len is not None and any(len(side) > max_seq_len for side, _ in sides):
            cut += 1
            if not all(any(side_mask[:max_seq_len]) for _, side_mask in sides):
                dropped += 1
    ordered = sorted(lengths)
    stats: dict[str, Any] = {
        "total": sum(lengths), "assistant": labels, "min": ordered[0], "max": ordered[-1],
        "mean": round(sum(lengths) / len(lengths), 1), "median": _percentile(ordered, 50),
        "p95": _percentile(ordered, 95)}
    if max_seq_len is not None:
        stats.update(max_seq_len=max_seq_len, over_max_seq_len=cut, dropped_at_max_seq_len=dropped)
    return stats


def _percentile(ordered: list[int], q: float) -> int:
    """Nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def load_chat_tokenizer(model: Path) -> Any:
    """The tokenizer of a local model directory, which must have a chat template (jobs render with it)."""
    if not model.is_dir():
        raise DataSourceError(f"--model {model}: not a local model directory")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError) as error:
        raise DataSourceError(f"--model {model}: no tokenizer there ({str(error).splitlines()[0]})") from None
    if not getattr(tokenizer, "chat_template", None):
        raise DataSourceError(f"--model {model}: the tokenizer has no chat template (training renders records with it)")
    return tokenizer


def render_text(report: CheckReport, *, most_duplicates: int = 10) -> str:
    """The human summary (problems first, one a line)."""
    lines = list(report.problems)
    t, c = report.turns, report.chars
    lines.append(f"{report.path}: {report.records} records, {t.get('total', 0)} turns "
                 f"({t.get('system', 0)} system, {t.get('user', 0)} user, {t.get('assistant', 0)} assistant), "
                 f"{c.get('total', 0)} characters ({c.get('assistant', 0)} in assistant turns)")
    if report.tokens:
        k = report.tokens
        line = (f"tokens: {k['total']} in all, {k['assistant']} assistant (trained on); per record min {k['min']}, "
                f"median {k['median']}, mean {k['mean']}, p95 {k['p95']}, max {k['max']}")
        if "max_seq_len" in k:
            line += (f"; {k['over_max_seq_len']} over max_seq_len {k['max_seq_len']} (cut), "
                     f"{k['dropped_at_max_seq_len']} of them left with no assistant token (dropped)")
        lines.append(line)
    if report.duplicates:
        shown = ", ".join(f"line {a} = line {b}" for a, b in report.duplicates[:most_duplicates])
        more = f", and {len(report.duplicates) - most_duplicates} more" if len(report.duplicates) > most_duplicates else ""
        lines.append(f"warning: {len(report.duplicates)} duplicate records ({shown}{more})")
    if report.empty_assistant:
        shown = ", ".join(map(str, report.empty_assistant[:most_duplicates]))
        lines.append(f"warning: {len(report.empty_assistant)} records with an empty assistant turn (lines {shown}"
                     f"{', ...' if len(report.empty_assistant) > most_duplicates else ''})")
    lines.append(f"ok: {report.path} is a valid ChatML dataset" if report.ok
                 else f"{report.path}: {len(report.problems)} problems")
    return "\n".join(lines)
