"""What both kinds of dataset records share: bounded JSONL reading, its errors, the tokenized example.

Rules of this file:
- A dataset is JSONL: one record per line, each line read within ``MAX_LINE_BYTES`` (never the file
  whole), blank lines skipped. What a record is belongs to its reader: ChatML conversations
  (agent/train/data.py) or preference records (agent/train/preference.py), each a ``make`` function of
  ``read_jsonl``. A bad line raises DataError ``FILE:LINE: problem``; with ``skip_bad`` bad lines are
  counted and listed instead.
- ``assistant_mask`` renders a conversation with the tokenizer's own chat template and marks the tokens
  an assistant turn wrote: from the template's ``{% generation %}`` mask when it has one, else by
  rendering each conversation prefix and taking the tokens each assistant turn adds.
- This module imports neither reader: both import it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from protocol.errors import ProtocolError

ROLES = ("system", "user", "assistant")
IGNORE_INDEX = -100
MAX_LINE_BYTES = 16 << 20
GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


class DataError(ProtocolError):
    """A dataset line is not a valid record (ChatML or preference); ``str()`` is ``FILE:LINE: problem``."""

    def __init__(self, location: str, problem: str) -> None:
        self.location = location
        self.problem = problem
        super().__init__(f"{location}: {problem}")


@dataclass
class ChatmlFile:
    """A dataset file's records (of either kind) and what was skipped on the way."""

    path: str
    records: list[Any]  # Record (data.py) or PreferenceRecord (preference.py)
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


def read_jsonl(path: str | Path, make: Callable[[int, Any], Any], *, skip_bad: bool = False) -> ChatmlFile:
    """Read a JSONL dataset line by line, each line within its bound: ``make(line_number, obj)`` builds a
    record or raises ValueError with the problem in a few words; DataError ``FILE:LINE: problem`` on the
    first bad line unless ``skip_bad`` (then counted and listed)."""
    from agent.files import FileInputError, input_file

    out = ChatmlFile(str(path), [])
    try:
        handle = open(input_file(path, "dataset"), "rb")  # a regular file: /dev/zero or a FIFO was read forever
    except FileInputError as error:
        raise DataError(str(path), str(error).split(": ", 1)[-1]) from None
    except OSError as error:
        raise DataError(str(path), f"cannot read: {error.strerror or error}") from None
    with handle:
        number = 0
        while True:
            raw = handle.readline(MAX_LINE_BYTES + 1)  # a line is read within its bound, never whole
            if not raw:
                break
            number += 1
            too_long = len(raw) > MAX_LINE_BYTES
            if too_long:
                while raw and not raw.endswith(b"\n"):  # skip the rest of it
                    raw = handle.readline(1 << 20)
            elif not raw.strip():
                continue
            try:
                if too_long:
                    raise ValueError(f"line longer than {MAX_LINE_BYTES} bytes")
                record = make(number, json.loads(raw.decode("utf-8")))
            except UnicodeDecodeError:
                problem = "not UTF-8 text"
            except json.JSONDecodeError as error:
                problem = f"not valid JSON ({error.msg} at column {error.colno})"
            except RecursionError:
                problem = "JSON nested too deeply"
            except ValueError as error:
                problem = str(error)
            else:
                out.records.append(record)
                continue
            if not skip_bad:
                raise DataError(f"{path}:{number}", problem)
            out.skipped += 1
            out.problems.append(f"{path}:{number}: {problem}")
    return out


def check_messages(messages: list, name: str) -> list[dict[str, str]]:
    """``messages`` as plain {role, content} dicts, each an object with a known role and text content;
    ValueError naming the first that is not (``name[i].role ...``)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{name}[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{name}[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def n_label_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


def assistant_mask(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
    """A conversation's token IDs under the chat template, and 1 for each token an assistant turn wrote
    (what ``tokenize`` trains on; agent/data/check.py counts them)."""
    if GENERATION_BLOCK.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    # no {% generation %} block: each assistant turn is what it adds to the rendered prefix
    ids = list(tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True)["input_ids"])
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(
            list(messages[:i]), tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
        upto = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=True, return_dict=True)["input_ids"]
        for position in range(len(before), min(len(upto), len(ids))):
            mask[position] = 1
    return ids, mask
