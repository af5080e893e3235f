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
