"""Preference records for DPO jobs: read the layouts TRL accepts, keep one canonical form, tokenize pairs.

Rules of this file (the format is IPIP-0007 "input.format: preference"; the loss IPIP-0005 §6.2):
- A record is one JSON object a line with a prompt, a chosen and a rejected completion, in one of
  the layouts TRL's DPOTrainer reads:
      {"prompt": "text", "chosen": "text", "rejected": "text"}                    standard
      {"prompt": [messages], "chosen": [messages], "rejected": [messages]}       conversational
      {"chosen": [messages], "rejected": [messages]}                             implicit prompt
  A text prompt is one user turn and a text completion one assistant turn (rendered with the
  model's chat template, like every job here). With an implicit prompt, the prompt is the turns
  both conversations open with. The prompt must end with a user or system turn; each completion
  starts with an assistant turn and has assistant text. ``meta`` is kept, other keys ignored.
- Whatever the layout read, a shard holds the canonical conversational form
  ``{"prompt": [...], "chosen": [...], "rejected": [...], "meta": {...}}``: what workers and
  verifiers read is one layout.
- A pair tokenizes to two examples, prompt + chosen and prompt + rejected, each cut at
  ``max_seq_len``, with labels on the completion's assistant tokens only (prompt turns, even an
  assistant turn inside a multi-turn prompt, are never labels). A pair either of whose sides has no
  label left is dropped (counted; the same on every machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from agent.train.records import IGNORE_INDEX, ChatmlFile, Example, assistant_mask, check_messages, read_jsonl

LAYOUTS = "prompt/chosen/rejected as text or as lists of messages, or chosen/rejected conversations"


@dataclass(frozen=True)
class PreferenceRecord:
    line: int
    prompt: tuple[dict[str, str], ...]
    chosen: tuple[dict[str, str], ...]
    rejected: tuple[dict[str, str], ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"prompt": list(self.prompt), "chosen": list(self.chosen), "rejected": list(self.rejected),
                "meta": self.meta}

    def learnable(self) -> bool:
        return True  # read_preferences refuses a completion without assistant text


@dataclass(frozen=True)
class PreferencePair:
    """One preference record as training sees it: the chosen and the rejected conversation."""

    chosen: Example
    rejected: Example

    @property
    def n_label_tokens(self) -> int:
        return self.chosen.n_label_tokens + self.rejected.n_label_tokens

    @property
    def n_tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)


def _messages(value: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f'"{name}" must be text or a non-empty list of messages')
    return check_messages(value, name)


def _side(value: Any, name: str, role: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, name)


def check_preference(obj: Any) -> tuple[tuple, tuple, tuple, dict[str, Any]]:
    """(prompt, chosen, rejected, meta) of a record in any layout, or ValueError with the problem in a few words."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "chosen" not in obj or "rejected" not in obj:
        missing = "chosen" if "chosen" not in obj else "rejected"
        raise ValueError(f'a preference record needs "{missing}" ({LAYOUTS})')
    if "prompt" in obj:
        prompt = _side(obj["prompt"], "prompt", "user")
        chosen = _side(obj["chosen"], "chosen", "assistant")
        rejected = _side(obj["rejected"], "rejected", "assistant")
    else:  # implicit prompt: the turns both conversations open with
        if not isinstance(obj["chosen"], list) or not isinstance(obj["rejected"], list):
            raise ValueError('without "prompt", "chosen" and "rejected" must be conversations (lists of '
                             "messages) that open with the same prompt turns")
        whole_chosen, whole_rejected = _messages(obj["chosen"], "chosen"), _messages(obj["rejected"], "rejected")
        shared = 0
        while shared < min(len(whole_chosen), len(whole_rejected)) and \
                whole_chosen[shared] == whole_rejected[shared]:
            shared += 1
        while shared and whole_chosen[shared - 1]["role"] == "assistant":  # a completion starts at an assistant turn
            shared -= 1
        if shared == 0:
            raise ValueError('"chosen" and "rejected" share no prompt turns: give "prompt" separately')
        prompt, chosen, rejected = whole_chosen[:shared], whole_chosen[shared:], whole_rejected[shared:]
    if prompt[-1]["role"] == "assistant":
        raise ValueError("prompt must end with a user or system turn, not an assistant turn")
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if not side:
            raise ValueError(f'"{name}" has no completion after the prompt')
        if side[0]["role"] != "assistant":
            raise ValueError(f"{name}[0].role must be assistant (the completion), got {side[0]['role']!r}")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in side):
            raise ValueError(f'"{name}" has no assistant text')
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError('"meta" must be an object')
    return tuple(prompt), tuple(chosen), tuple(rejected), meta


def read_preferences(path: str | Path, *, skip_bad: bool = False) -> ChatmlFile:
    """Parse a JSONL file of preference records; DataError ``FILE:LINE: problem`` on the first bad line
    unless ``skip_bad``."""
    return read_jsonl(path, lambda number, obj: PreferenceRecord(number, *check_preference(obj)), skip_bad=skip_bad)


def _completion_example(tokenizer: Any, prompt: Sequence[dict], completion: Sequence[dict],
                        max_seq_len: int) -> Example:
    ids, mask = assistant_mask(tokenizer, list(prompt) + list(completion))
    start = len(tokenizer.apply_chat_template(list(prompt), tokenize=True, return_dict=True,
                                              add_generation_prompt=True)["input_ids"])
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    labels = tuple(token if keep and position >= start else IGNORE_INDEX
                   for position, (token, keep) in enumerate(zip(ids, mask)))
    return Example(tuple(ids), labels)


def tokenize_pairs(tokenizer: Any, records: Sequence[PreferenceRecord],
                   max_seq_len: int) -> tuple[list[PreferencePair], int]:
    """A pair per record, labels on the completions only; and how many records were dropped (a side cut
    to no label)."""
    pairs, dropped = [], 0
    for record in records:
        chosen = _completion_example(tokenizer, record.prompt, record.chosen, max_seq_len)
        rejected = _completion_example(tokenizer, record.prompt, record.rejected, max_seq_len)
        if not chosen.n_label_tokens or not rejected.n_label_tokens:
            dropped += 1
            continue
        pairs.append(PreferencePair(chosen, rejected))
    return pairs, dropped


EVASIONS = ("I do not know.", "I cannot answer that.", "Ask someone else.", "No.", "Maybe later.",
            "That is not something I can help with.")


def demo_preferences(n: int = 400, seed: int = 0, wrong_share: float = 0.25) -> list[dict]:
    """``n`` preference records of the demo task (agent/train/tiny.demo_records): the chosen completion is
    the right answer; the rejected one an evasion (``EVASIONS``), or for ``wrong_share`` of them a plausible
    wrong answer of the same kind (another colour, another French word, a miscount, a misspelling). The tiny
    model knows no facts, so it learns the first kind across records and the second one record at a time.
    The same for the same arguments."""
    import random

    from agent.train.tiny import COLOURS, FRENCH, demo_records

    rng = random.Random(seed + 7919)
    out = []
    for record in demo_records(n, seed=seed):
        messages, task = record["messages"], record["meta"]["task"]
        answer = messages[-1]["content"]
        if rng.random() >= wrong_share:
            rejected = rng.choice(EVASIONS)
        elif task == "colour":
            thing = answer.split()[1]
            rejected = f"The {thing} is {rng.choice(sorted(set(COLOURS.values()) - {COLOURS[thing]}))}."
        elif task == "french":
            word = answer.split()[0]
            rejected = f"{word} in French is {rng.choice(sorted(set(FRENCH.values()) - {FRENCH[word]}))}."
        elif task == "count":
            numbers = [int(k) for k in answer.rstrip(".").split(", ")]
            numbers[rng.randrange(1, 5)] += rng.choice((1, 2, 3))
            rejected = ", ".join(str(k) for k in numbers) + "."
        else:
            letters = answer.split("-")
            i = rng.randrange(len(letters))
            letters[i] = rng.choice([c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c != letters[i]])
            rejected = "-".join(letters)
        out.append({"prompt": messages[:-1], "chosen": [messages[-1]],
                    "rejected": [{"role": "assistant", "content": rejected}], "meta": record["meta"]})
    return out
