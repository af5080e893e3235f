"""input.hf: a Hugging Face dataset as a job's input, read with the datasets library (issue 26). Nothing can be
downloaded here, so the dataset is a local folder that datasets.load_dataset reads, the same call a user with a
Hub name and a token makes; the Hub is off (HF_HUB_OFFLINE), so a name not cached fails at once, as offline."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

# before anything imports datasets (agent/hfdata.py imports it lazily): no Hub, and a cache of our own
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="hf-datasets-"))

from agent.hfdata import HubDataError, materialize, to_chatml  # noqa: E402
from agent.train.data import read_chatml  # noqa: E402
from protocol.jobspec import parse_spec, to_terms  # noqa: E402
from tests.pipeline.conftest import assert_one_line_error, run_cli  # noqa: E402

pytest.importorskip("datasets")


def sharegpt_repo(root: Path, rows: int = 60) -> Path:
    """A dataset folder as it comes off the Hub: data/train.jsonl and data/test.jsonl, ShareGPT rows."""
    (root / "data").mkdir(parents=True)
    for split, count in (("train", rows), ("test", 8)):
        with open(root / "data" / f"{split}.jsonl", "w") as handle:
            for i in range(count):
                handle.write(json.dumps({"id": i, "conversations": [
                    {"from": "system", "value": "You answer with the number."},
                    {"from": "human", "value": f"What is {i} plus {i}?"},
                    {"from": "gpt", "value": f"{2 * i}"}]}) + "\n")
            handle.write(json.dumps({"id": -1, "conversations": [{"from": "human", "value": "no answer"}]}) + "\n")
    return root


@pytest.mark.parametrize("row, messages", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
     [("user", "hi"), ("assistant", "hello")]),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
     [("user", "hi"), ("assistant", "hello")]),
    ({"prompt": "hi", "completion": "hello"}, [("user", "hi"), ("assistant", "hello")]),
    ({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]},
     [("user", "hi"), ("assistant", "hello")]),
    ({"instruction": "add", "input": "1 1", "output": "2"}, [("user", "add\n\n1 1"), ("assistant", "2")]),
    ({"question": "hi?", "answer": "hello"}, [("user", "hi?"), ("assistant", "hello")]),
    ({"messages": [{"role": "user", "content": "hi"}]}, None),  # nothing to learn: no assistant turn
    ({"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]}, None),
    ({"prompt": 3, "completion": "x"}, None),
])
def test_each_common_layout_becomes_chatml(row, messages):
    record = to_chatml(row)
    assert (None if record is None else [(m["role"], m["content"]) for m in record["messages"]]) == messages


def test_a_split_is_converted_once_into_chatml(tmp_path):
    repo = sharegpt_repo(tmp_path / "repo")
    path, written, dropped = materialize(str(repo), "train", cache_dir=tmp_path / "cache")
    assert (written, dropped) == (60, 1)
    records = read_chatml(path).records
    assert len(records) == 60 and records[3].messages[-1] == {"role": "assistant", "content": "6"}
    again, _, _ = materialize(str(repo), "test", cache_dir=tmp_path / "cache")
    assert again != path and len(read_chatml(again).records) == 8
    assert not list((tmp_path / "cache").glob("*.partial"))


@pytest.mark.parametrize("name, split, fragments", [
    ("REPO", "validation", ("split=validation", "Unknown split", "train")),
    ("nobody/no-such-dataset", "train", ("hf:nobody/no-such-dataset split=train", "not found, or not in the local cache")),
])
def test_an_unknown_dataset_or_split_is_one_line(tmp_path, name, split, fragments):
    repo = sharegpt_repo(tmp_path / "repo")
    with pytest.raises(HubDataError) as caught:
        materialize(str(repo) if name == "REPO" else name, split, cache_dir=tmp_path / "cache")
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_columns_that_are_no_conversation_are_named(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "train.jsonl").write_text(json.dumps({"text": "just text", "label": 1}) + "\n")
    with pytest.raises(HubDataError, match=r"columns \['label', 'text'\]; expected messages"):
        materialize(str(tmp_path / "repo"), "train", cache_dir=tmp_path / "cache")


def test_a_spec_with_input_hf_trains_and_its_terms_name_the_source(capsys, tmp_path, tiny_dir):
    repo = sharegpt_repo(tmp_path / "repo")
    spec_path = tmp_path / "infernet.train.yml"
    spec_path.write_text(f"""name: hf-demo
base_model: {tiny_dir}
input:
  hf: {repo}
  split: train
training: {{max_steps: 4, batch_size: 2, max_seq_len: 64}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
proof: {{checkpoint_every: 2, verify_segments: 1}}
""")
    code, _, err = run_cli(capsys, "train", "run", "--local", "--config", str(spec_path), "--output", str(tmp_path / "run"),
                           "--threads", "1", "--no-progress", "--json", "--home", str(tmp_path / "home"))
    assert code == 0, err
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 4
    # the converted split is what trained (the run keeps its data), and the terms name the Hub source
    assert len(read_chatml(tmp_path / "run" / "data" / "train.jsonl").records) == 60
    terms = to_terms(parse_spec(spec_path.read_text()), submitter="", base_model_sha256=bytes(32))
    assert terms.dataset_source == f"hf:{repo} split=train"


def test_an_unknown_split_in_a_spec_is_one_line_and_nothing_trains(capsys, tmp_path, tiny_dir):
    repo = sharegpt_repo(tmp_path / "repo")
    spec_path = tmp_path / "infernet.train.yml"
    spec_path.write_text(f"name: x\nbase_model: {tiny_dir}\ninput:\n  hf: {repo}\n  split: nope\n")
    code, _, err = run_cli(capsys, "train", "run", "--local", "--config", str(spec_path), "--output", str(tmp_path / "run"),
                           "--home", str(tmp_path / "home"))
    assert_one_line_error(code, err, "input.hf", "split=nope", "Unknown split")
    assert not (tmp_path / "run").exists()


def test_a_preference_split_becomes_canonical_preference_records(tmp_path):
    """A DPO job's input.hf: rows in the layouts TRL reads (here the implicit-prompt one, as in
    trl-lib/ultrafeedback_binarized) become prompt/chosen/rejected records; other rows are dropped."""
    from agent.train.preference import read_preferences

    (tmp_path / "repo" / "data").mkdir(parents=True)
    with open(tmp_path / "repo" / "data" / "train.jsonl", "w") as handle:
        for i in range(12):
            prompt = [{"role": "user", "content": f"What is {i} plus {i}?"}]
            handle.write(json.dumps({"chosen": prompt + [{"role": "assistant", "content": f"{2 * i}"}],
                                     "rejected": prompt + [{"role": "assistant", "content": f"{2 * i + 1}"}],
                                     "score_chosen": 9.0}) + "\n")
        handle.write(json.dumps({"chosen": [{"role": "assistant", "content": "x"}],
                                 "rejected": [{"role": "assistant", "content": "y"}]}) + "\n")  # no prompt: dropped
    path, written, dropped = materialize(str(tmp_path / "repo"), "train", cache_dir=tmp_path / "cache",
                                         format="preference")
    assert (written, dropped) == (12, 1)
    first = read_preferences(path).records[0]
    assert [m["content"] for m in first.prompt + first.chosen + first.rejected] == ["What is 0 plus 0?", "0", "1"]
    with pytest.raises(HubDataError, match="columns .*chosen.*; expected messages"):  # the same split, for sft
        materialize(str(tmp_path / "repo"), "train", cache_dir=tmp_path / "cache")
    with pytest.raises(HubDataError, match="a DPO job expects chosen and rejected"):
        materialize(str(sharegpt_repo(tmp_path / "sharegpt")), "train", cache_dir=tmp_path / "cache",
                    format="preference")
