"""`infernet data check FILE`: every bad line as FILE:LINE, counts, tokens with the job's tokenizer, duplicates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agent.cli import main
from tests.cli.conftest import assert_one_line_error, cli


@pytest.fixture
def check(capsys):
    """``infernet data check ARGS`` in this process (the imports are paid once): returncode, stdout, stderr."""

    def run(*args: str, check: bool = False) -> SimpleNamespace:
        code = main(["data", "check", *args])
        out, err = capsys.readouterr()
        if check and code != 0:
            raise AssertionError(f"data check {args} exited {code}: {err}")
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


def rec(user: str, answer: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages, "meta": {"id": user}})


def test_every_bad_line_is_named_and_the_check_fails(tmp_path, check):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        rec("What colour is snow?", "White."),
        '{"messages": [{"role": "user", "content": "hi"}]}',
        "not json",
        "",
        '{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
        rec("What colour is coal?", "Black."),
    ]) + "\n")
    done = cli("data", "check", str(path))  # as a user runs it
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == [f"{path}:2: no assistant message to learn from",
                         f"{path}:3: not valid JSON (Expecting value at column 1)",
                         f"{path}:5: messages[0].role must be one of system, user, assistant, got 'robot'"]
    assert f"{path}: 2 records" in done.stdout and lines[-1] == f"{path}: 3 problems"
    report = json.loads(check(str(path), "--json").stdout)
    assert report["ok"] is False and report["records"] == 2 and len(report["problems"]) == 3


def test_counts_duplicates_and_empty_answers(tmp_path, check):
    path = tmp_path / "good.jsonl"
    path.write_text("\n".join([rec("Q1", "Answer one.", system="Be brief."), rec("Q2", "Answer two."),
                               rec("Q1", "Answer one.", system="Be brief."), rec("Q3", "")]) + "\n")
    done = check(str(path), "--json", check=True)
    report = json.loads(done.stdout)
    assert report["turns"] == {"total": 10, "system": 2, "user": 4, "assistant": 4}
    assert report["chars"] == {"total": 2 * 9 + 4 * 2 + 3 * 11, "system": 18, "user": 8, "assistant": 33}
    assert report["duplicates"] == [{"line": 3, "first": 1}] and report["empty_assistant_lines"] == [4]
    text = check(str(path), check=True).stdout
    assert "warning: 1 duplicate records (line 3 = line 1)" in text and text.rstrip().endswith("valid ChatML dataset")


def test_tokens_with_the_jobs_tokenizer(tmp_path, tiny_model_dir, check):
    from transformers import AutoTokenizer

    path = tmp_path / "data.jsonl"
    records = [rec("What colour is snow?", "White."), rec("Spell cat.", "C-A-T " * 30)]
    path.write_text("\n".join(records) + "\n")
    done = check(str(path), "--model", str(tiny_model_dir), "--max-seq-len", "40", "--json", check=True)
    tokens = json.loads(done.stdout)["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    lengths = sorted(len(tokenizer.apply_chat_template(json.loads(r)["messages"], tokenize=True, return_dict=True)["input_ids"])
                     for r in records)
    assert (tokens["min"], tokens["max"], tokens["total"]) == (lengths[0], lengths[1], sum(lengths))
    assert 0 < tokens["assistant"] < tokens["total"]
    assert tokens["over_max_seq_len"] == 1 and tokens["dropped_at_max_seq_len"] == 0 and lengths[1] > 40
    text = check(str(path), "--model", "infernet-tiny", check=True).stdout
    assert f"tokens: {sum(lengths)} in all" in text


def test_one_line_errors(tmp_path, check):
    assert_one_line_error(cli("data", "check", str(tmp_path / "nope.jsonl")), "nope.jsonl")
    assert_one_line_error(cli("data", "check", str(tmp_path)), "not a regular file")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = check(str(empty))
    assert done.returncode == 1 and f"{empty}: no records" in done.stdout
    assert_one_line_error(cli("data", "check", str(empty), "--model", str(tmp_path / "nomodel")), "not a local model directory")
    assert_one_line_error(cli("data", "check", str(empty), "--max-seq-len", "10"), "--max-seq-len needs --model")


def test_a_preference_file_is_checked_as_one_and_its_pairs_counted(tmp_path, check):
    """A DPO job's records (found from the first one having "chosen"): bad lines named, both sides' tokens
    counted, a pair cut to no label on either side counted as dropped."""
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "What colour is snow?", "chosen": "White.", "rejected": "I do not know."}),
        json.dumps({"prompt": "hi", "chosen": "hello"}),
        json.dumps({"chosen": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}],
                    "rejected": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "No."}]}),
    ]) + "\n")
    result = check(str(path), "--model", "infernet-tiny", "--max-seq-len", "12", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["records"] == 2
    assert report["problems"] == [f"{path}:2: a preference record needs \"rejected\" (prompt/chosen/rejected as text "
                                  "or as lists of messages, or chosen/rejected conversations)"]
    assert report["turns"] == {"total": 6, "system": 0, "user": 2, "assistant": 4}
    # at 12 tokens the first pair keeps no completion token (its prompt alone is 14), the second keeps one
    assert report["tokens"]["over_max_seq_len"] == 2 and report["tokens"]["dropped_at_max_seq_len"] == 1
    as_chatml = check(str(path), "--format", "chatml", "--json")  # the same file read as ChatML: every line bad
    assert len(json.loads(as_chatml.stdout)["problems"]) == 3
