"""ChatML JSONL in, token ids with assistant-only labels out; deterministic shards and batches.

Rules of this file:
- A dataset is JSONL, one record per line: ``{"messages": [{"role": "system"|"user"|"assistant",
  "content": str}, ...], "meta": {...}}``; other top-level keys are ignored, blank lines skipped.
  A record needs at least one assistant message. A bad line raises DataError ``FILE:LINE: problem``;
  with ``skip_bad=True`` bad lines are counted and skipped instead.
- The bounded line reader, DataError, the tokenized Example and the assistant mask are
  agent/train/records.py's (shared with preference records, agent/train/preference.py: a DPO job's
  dataset; ``read_records``, ``check_dataset`` and ``prepare_examples`` take either kind).
- Records are rendered with the tokenizer's own chat template. Labels are the token ids of the
  assistant turns and -100 everywhere else: from the template's ``{% generation %}`` mask when it
  has one, else by rendering each conversation prefix and taking the tokens each assistant turn
  adds. Sequences are cut at ``max_seq_len``; a record left with no assistant token is dropped
  (counted, deterministic, so every machine drops the same ones).
- Packing (optional) concatenates whole examples, in order, into sequences of at most
  ``max_seq_len`` tokens; attention is not masked between packed examples.
- Splits and sample order come from SHA-256 of (domain, seed, index), never from a library RNG,
  so they are identical on every machine and every version: ``split_dataset`` (validation, then
  N near-equal shards) and ``step_samples`` (which examples optimizer step s uses; each epoch is
  a fresh permutation and steps run on across epoch boundaries).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from agent.train.preference import read_preferences, tokenize_pairs
from agent.train.records import (  # noqa: F401 - re-exported: what data users import from here
    IGNORE_INDEX, ChatmlFile, DataError, Example, assistant_mask, check_messages, read_jsonl,
)
from protocol import proof

@dataclass(frozen=True)
class Record:
    line: int
    messages: tuple[dict[str, str], ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"messages": list(self.messages), "meta": self.meta}

    def learnable(self) -> bool:
        """Whether it has assistant text to learn from."""
        return any(m["role"] == "assistant" and m["content"].strip() for m in self.messages)


def _check_record(obj: Any) -> tuple[tuple[dict[str, str], ...], dict[str, Any]]:
    """The record's messages and meta, or ValueError with the problem in a few words."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    messages = check_messages(messages, "messages")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message to learn from")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError('"meta" must be an object')
    return tuple({"role": m["role"], "content": m["content"]} for m in messages), meta


def read_chatml(path: str | Path, *, skip_bad: bool = False) -> ChatmlFile:
    """Parse a ChatML JSONL file; DataError on the first bad line unless ``skip_bad``."""
    return read_jsonl(path, lambda number, obj: Record(number, *_check_record(obj)), skip_bad=skip_bad)


def read_records(path: str | Path, format: str = "chatml", *, skip_bad: bool = False) -> ChatmlFile:
    """A dataset file in ``format`` (IPIP-0007 ``input.format``): ChatML conversations, or preference
    records (agent/train/preference.py) for a DPO job."""
    if format == "preference":
        return read_preferences(path, skip_bad=skip_bad)
    if format != "chatml":
        raise ValueError(f"unknown dataset format {format!r}")
    return read_chatml(path, skip_bad=skip_bad)


def write_chatml(path: str | Path, records: Sequence[Any]) -> None:
    """Write records as JSONL, one compact JSON object per line: ChatML records, or preference records in
    their canonical form (agent/train/preference.py)."""
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(_chatml_line(record))


def _chatml_line(record: Any) -> str:
    if not isinstance(record, dict):
        record = record.to_json()
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


# --- tokenization -------------------------------------------------------------------------------


def tokenize(tokenizer: Any, records: Sequence[Record], max_seq_len: int) -> tuple[list[Example], int]:
    """Examples with assistant-only labels, cut at ``max_seq_len``; and how many were dropped empty."""
    examples, dropped = [], 0
    for record in records:
        ids, mask = assistant_mask(tokenizer, record.messages)
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        labels = tuple(token if keep else IGNORE_INDEX for token, keep in zip(ids, mask))
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            continue
        examples.append(Example(tuple(ids), labels))
    return examples, dropped


def pack(examples: Sequence[Example], max_seq_len: int) -> list[Example]:
    """Concatenate whole examples in order into sequences of at most ``max_seq_len`` tokens."""
    packed: list[Example] = []
    ids: list[int] = []
    labels: list[int] = []
    for example in examples:
        if ids and len(ids) + len(example.input_ids) > max_seq_len:
            packed.append(Example(tuple(ids), tuple(labels)))
            ids, labels = [], []
        ids.extend(example.input_ids)
        labels.extend(example.labels)
    if ids:
        packed.append(Example(tuple(ids), tuple(labels)))
    return packed


# --- deterministic order ------------------------------------------------------------------------


def _keyed_order(domain: bytes, seed: int, salt: int, n: int) -> list[int]:
    prefix = domain + struct.pack("<QQ", seed, salt)
    return sorted(range(n), key=lambda i: hashlib.sha256(prefix + struct.pack("<Q", i)).digest())


@dataclass(frozen=True)
class Split:
    validation: tuple[int, ...]
    shards: tuple[tuple[int, ...], ...]


def split_dataset(n_records: int, n_shards: int, validation_fraction: float, seed: int) -> Split:
    """Record indices for the validation split and each shard; each list in ascending order.

    Records are ordered by SHA-256("infernet/split/v1", seed, 0, index); the first
    round(fraction * n) go to validation, the rest into ``n_shards`` contiguous near-equal parts
    (the first ``rest % n_shards`` parts one record longer).
    """
    if n_shards < 1 or not 0 <= validation_fraction < 1:
        raise ValueError("need n_shards >= 1 and 0 <= validation_fraction < 1")
    order = _keyed_order(b"infernet/split/v1\0", seed, 0, n_records)
    n_validation = round(validation_fraction * n_records)
    validation, rest = order[:n_validation], order[n_validation:]
    base, extra = divmod(len(rest), n_shards)
    shards, start = [], 0
    for j in range(n_shards):
        end = start + base + (1 if j < extra else 0)
        shards.append(tuple(sorted(rest[start:end])))
        start = end
    return Split(tuple(sorted(validation)), tuple(shards))


def check_dataset(path: str | Path, n_shards: int, validation_fraction: float, seed: int,
                  format: str = "chatml") -> ChatmlFile:
    """Read a job's dataset (in ``format``: read_records) and check that every shard it splits into can be
    trained, before anything is written or sent: DataError ``FILE: problem`` if it has no records, fewer
    training records than shards, or a shard whose assistant turns are all empty (nothing to learn from)."""
    data = read_records(path, format)
    n = len(data.records)
    if n == 0:
        raise DataError(str(path), "no records: the dataset is empty")
    split = split_dataset(n, n_shards, validation_fraction, seed)
    training = n - len(split.validation)
    if any(not shard for shard in split.shards):
        held = f" ({len(split.validation)} held out for validation)" if split.validation else ""
        raise DataError(str(path), f"{n} records{held} leave {training} to train for {n_shards} shards: "
                                   "every shard needs at least one record")
    for index, shard in enumerate(split.shards):
        if not any(data.records[i].learnable() for i in shard):
            which = f"shard {index} (lines {_lines(data, shard)})" if n_shards > 1 else "the training split"
            raise DataError(str(path), f"{which} has no assistant text to learn from: every assistant "
                                       "message is empty")
    if split.validation:  # a coordinator fetches at most the shards' bytes of it (JobTerms.validation_size_bound)
        def size(indices: Sequence[int]) -> int:
            return sum(len(_chatml_line(data.records[i]).encode()) for i in indices)

        held, trained = size(split.validation), sum(size(shard) for shard in split.shards)
        if held > trained:
            raise DataError(str(path), f"the validation split ({len(split.validation)} records, {held} bytes) is "
                                       f"larger than the {training} training records ({trained} bytes), the most a "
                                       "coordinator fetches of it; lower input.validation_split")
    return data


def _lines(data: ChatmlFile, indices: Sequence[int], most: int = 5) -> str:
    lines = [str(data.records[i].line) for i in indices[:most]]
    return ", ".join(lines) + (", ..." if len(indices) > most else "")


@lru_cache(maxsize=8)
def epoch_order(n_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The permutation of a shard's examples for one epoch (IPIP-0005 §6, protocol.proof)."""
    return proof.epoch_order(n_examples, seed, epoch)


def step_samples(n_examples: int, samples_per_step: int, seed: int, step: int) -> list[int]:
    """Example indices optimizer step ``step`` (0-based) uses, in micro-batch order."""
    if n_examples < 1:
        raise ValueError("a shard needs at least one example")
    out = []
    for position in range(step * samples_per_step, (step + 1) * samples_per_step):
        epoch, offset = divmod(position, n_examples)
        out.append(epoch_order(n_examples, seed, epoch)[offset])
    return out


@dataclass
class PreparedShard:
    """A shard's training examples and what was left out on the way."""

    examples: list[Example]
    records: int
    skipped_lines: int
    dropped_examples: int


def prepare_examples(path: str | Path, tokenizer: Any, *, max_seq_len: int, packing: bool = False,
                     skip_bad: bool = False, objective: str = "sft") -> PreparedShard:
    """Read, tokenize and (optionally) pack a shard: exactly what a step's indices refer to. A DPO shard
    (``objective`` "dpo") holds preference records, and its examples are PreferencePairs."""
    if objective == "dpo":
        chatml = read_preferences(path, skip_bad=skip_bad)
        pairs, dropped = tokenize_pairs(tokenizer, chatml.records, max_seq_len)
        return PreparedShard(pairs, len(chatml.records), chatml.skipped, dropped)
    chatml = read_chatml(path, skip_bad=skip_bad)
    examples, dropped = tokenize(tokenizer, chatml.records, max_seq_len)
    if packing:
        examples = pack(examples, max_seq_len)
    return PreparedShard(examples, len(chatml.records), chatml.skipped, dropped)
