"""Datasets from the Hugging Face Hub (or its cache, or a local dataset folder) as a job's input (issue 26).

Rules of this file:
- ``input: {hf: NAME, split: train, config: ..., revision: ...}`` is read with the ``datasets`` library
  (``datasets.load_dataset``: a Hub name, which uses the local cache and ``HF_TOKEN`` as datasets does, or a
  local folder it can read); nothing here parses parquet or arrow by hand.
- ``materialize`` converts the split into the canonical ChatML JSONL (agent/train/data.py), written to a
  file named by a hash of (name, config, split, revision) under ``cache_dir``, atomically (a temporary
  file, then a rename); datasets' own cache keeps the download. From then on the job is a file like any other:
  the submitter shards it and adds the parts by CID, and records the Hub source in the terms
  (``JobTerms.dataset_source``) beside the CID; workers only ever fetch CIDs.
- Rows become ChatML by their columns, in this order: ``messages`` (role/content lists, as is);
  ``conversations`` (ShareGPT: from/value, human/gpt/system); ``prompt`` + ``completion`` (TRL's
  prompt-completion, text or message lists); ``instruction`` (+ ``input``) + ``output`` (Alpaca);
  ``question`` + ``answer``. Other columns are ignored; a split with none of these is one line naming
  its columns. A row that does not convert is dropped and counted. For a DPO job (``input.format:
  preference``) rows are preference records in a layout TRL reads (prompt/chosen/rejected).
- An unknown dataset, config or split, or no network for a name not cached, is one line (HubDataError).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

from protocol.jobspec import describe_hf as describe  # the one spelling of a Hub source (JobTerms.dataset_source)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "system": "system"}


class HubDataError(ValueError):
    """The dataset, config or split cannot be read; ``str()`` is the one line to show."""


def materialize(name: str, split: str = "train", config: str = "", revision: str = "", *,
                cache_dir: Path, format: str = "chatml") -> tuple[Path, int, int]:
    """(JSONL path, records written, rows dropped) for one split of a Hugging Face dataset: ChatML, or with
    ``format`` "preference" the canonical preference records of a DPO job (``to_preference``)."""
    key = hashlib.sha256(json.dumps([name, config, split, revision] + ([format] if format != "chatml" else []))
                         .encode()).hexdigest()[:24]
    out = cache_dir / f"hf-{key}.jsonl"
    rows = load_rows(name, split, config, revision, format)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    written = dropped = 0
    with open(partial, "w", encoding="utf-8") as handle:
        for row in rows:
            record = to_preference(row) if format == "preference" else to_chatml(row)
            if record is None:
                dropped += 1
                continue
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    if not written:
        partial.unlink(missing_ok=True)
        what = "a preference record (prompt/chosen/rejected)" if format == "preference" else "a conversation"
        raise HubDataError(f"{describe(name, config, split, revision)}: no row converts to {what} "
                           f"({dropped} rows dropped)")
    os.replace(partial, out)
    return out, written, dropped


def spec_dataset(input_spec: Any, cache_dir: Path) -> Path:
    """The ChatML file of a spec's ``input.hf`` (materialized under ``cache_dir``); HubDataError otherwise."""
    path, _, _ = materialize(input_spec.hf, input_spec.split, input_spec.config, input_spec.revision,
                             cache_dir=cache_dir, format=input_spec.format)
    return path


def load_rows(name: str, split: str, config: str, revision: str, format: str = "chatml") -> Iterable[dict]:
    """The rows of the split, through datasets.load_dataset; HubDataError (one line) when it cannot be read."""
    where = describe(name, config, split, revision)
    try:
        import datasets
    except ImportError:
        raise HubDataError(f"{where}: reading Hugging Face datasets needs the datasets package "
                           "(pip install 'infernet-agent[hf]')") from None
    datasets.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    try:
        data = datasets.load_dataset(name, config or None, split=split, revision=revision or None)
    except ValueError as error:  # unknown split or config
        raise HubDataError(f"{where}: {str(error).splitlines()[0]}") from None
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise HubDataError(f"{where}: not found, or not in the local cache and the Hub cannot be reached "
                           f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
    except Exception as error:  # noqa: BLE001 - datasets raises many kinds (DatasetNotFoundError, ...): one line
        raise HubDataError(f"{where}: {type(error).__name__}: {str(error).splitlines()[0][:200]}") from None
    columns = set(data.column_names)
    if format == "preference":
        if not {"chosen", "rejected"} <= columns:
            raise HubDataError(f"{where}: columns {sorted(columns)}; a DPO job expects chosen and rejected "
                               "(and prompt, unless the conversations share it)")
    elif not (columns & {"messages", "conversations"} or {"prompt", "completion"} <= columns
            or {"instruction", "output"} <= columns or {"question", "answer"} <= columns):
        raise HubDataError(f"{where}: columns {sorted(columns)}; expected messages, conversations (ShareGPT), "
                           "prompt + completion, instruction + output (Alpaca) or question + answer")
    return data


def _messages(value: Any, role_key: str = "role", content_key: str = "content") -> list[dict] | None:
    if not isinstance(value, list):
        return None
    out = []
    for turn in value:
        if not isinstance(turn, dict):
            return None
        role = turn.get(role_key)
        content = turn.get(content_key)
        if role_key == "from":
            role = SHAREGPT_ROLES.get(str(role).lower())
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out or None


def _turns(value: Any, role: str) -> list[dict] | None:
    """A prompt or completion: text, or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value)


def to_preference(row: dict) -> dict | None:
    """A row in one of the preference layouts TRL reads (agent/train/preference.py) as its canonical record;
    None if it is not one."""
    from agent.train.preference import PreferenceRecord, check_preference

    try:
        return PreferenceRecord(0, *check_preference({k: row[k] for k in ("prompt", "chosen", "rejected") if k in row}))\
            .to_json()
    except ValueError:
        return None


def to_chatml(row: dict) -> dict | None:
    """One row as a ChatML record ({"messages": [...]}) ending with an assistant turn, or None."""
    messages: list[dict] | None = None
    if "messages" in row:
        messages = _messages(row["messages"])
    elif "conversations" in row:
        messages = _messages(row["conversations"], "from", "value")
    elif "prompt" in row and "completion" in row:
        prompt, completion = _turns(row["prompt"], "user"), _turns(row["completion"], "assistant")
        messages = prompt + completion if prompt and completion else None
    elif "instruction" in row and "output" in row:
        instruction, extra = row.get("instruction"), row.get("input")
        if isinstance(instruction, str) and isinstance(row["output"], str):
            text = instruction + (f"\n\n{extra}" if isinstance(extra, str) and extra.strip() else "")
            messages = [{"role": "user", "content": text}, {"role": "assistant", "content": row["output"]}]
    elif "question" in row and "answer" in row:
        if isinstance(row["question"], str) and isinstance(row["answer"], str):
            messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
    if not messages or not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None
    return {"messages": messages}
