"""train init --from: a TRL config or an Axolotl YAML becomes our spec, every field not honoured named (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.train.presets import spec_with_values
from agent.train.tiny import demo_records
from agent.train.data import write_chatml
from protocol.jobspec import parse_spec
from tests.pipeline.conftest import assert_one_line_error, run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def convert(capsys, tmp_path: Path, source: Path) -> tuple[str, list[str]]:
    code, out, err = run_cli(capsys, "train", "init", "--from", str(source), "--output", str(tmp_path))
    assert code == 0, err
    notes = [line[len(f"{source}: "):] for line in out.splitlines() if line.startswith(f"{source}: ")]
    return (tmp_path / "infernet.train.yml").read_text(), notes


def test_a_trl_config_becomes_a_spec_that_trains(capsys, tmp_path, tiny_dir):
    text, notes = convert(capsys, tmp_path, EXAMPLES / "trl_sft.yaml")
    spec = parse_spec(text)
    assert (spec.name, spec.base_model, spec.seed, spec.method) == ("qwen2.5-0.5b-sft-lora", "Qwen/Qwen2.5-0.5B-Instruct",
                                                                   42, "lora")
    t = spec.training
    assert (t.epochs, t.learning_rate, t.batch_size, t.gradient_accumulation_steps, t.max_seq_len, t.packing) == (
        1, 2e-4, 8, 2, 1024, True)
    assert t.inner_schedule == "triangle"  # lr_scheduler_type: cosine, the closest offered
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout) == (16, 32.0, 0.0)
    assert spec.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert str(spec.input.dataset) == "train.jsonl" or spec.input.dataset.endswith("train.jsonl")
    # every field it could not take as written, one line each, named; the same lines close the spec file
    named = [line.split(":", 1)[0] for line in notes]
    assert named == ["lora_target_modules", "lr_scheduler_type", "warmup_ratio", "bf16/fp16/gradient_checkpointing"]
    assert all(f"#   {line}" in text for line in notes)
    # the converted spec trains, here on the tiny model and a few steps
    write_chatml(tmp_path / "train.jsonl", demo_records(120, seed=3))
    local = spec_with_values(text, {("", "base_model"): str(tiny_dir), ("input", "dataset"): str(tmp_path / "train.jsonl"),
                                    ("training", "max_seq_len"): "64", ("training", "max_steps"): "4",
                                    ("training", "batch_size"): "2", ("proof", "checkpoint_every"): "2"})
    (tmp_path / "local.yml").write_text(local)
    code, _, err = run_cli(capsys, "train", "run", "--local", "--config", str(tmp_path / "local.yml"), "--output",
                           str(tmp_path / "run"), "--threads", "1", "--no-progress", "--json")
    assert code == 0, err
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 4 and result["checkpoints"] == 2


def test_an_axolotl_config_becomes_a_spec(capsys, tmp_path):
    text, notes = convert(capsys, tmp_path, EXAMPLES / "axolotl.yml")
    spec = parse_spec(text)
    assert (spec.name, spec.base_model, spec.seed) == ("qwen-lora", "Qwen/Qwen2.5-0.5B-Instruct", 7)
    t = spec.training
    assert (t.epochs, t.learning_rate, t.batch_size, t.gradient_accumulation_steps, t.max_seq_len, t.packing) == (
        2, 2e-4, 4, 4, 1024, True)
    assert spec.input.validation_split == 0.05 and (spec.lora.rank, spec.lora.alpha, spec.lora.dropout) == (16, 32, 0.05)
    assert len(spec.lora.target_modules) == 7  # lora_target_linear
    assert [line.split(":", 1)[0] for line in notes] == [
        "lora_target_linear", "lr_scheduler", "warmup_steps", "optimizer", "bf16/fp16/gradient_checkpointing"]


@pytest.mark.parametrize("config, named", [
    ({"model_name_or_path": "m", "frobnicate": 3}, ["frobnicate"]),  # an unknown field is named, not dropped
    ({"model_name_or_path": "m", "use_peft": False}, ["use_peft"]),  # full fine-tuning is not offered
    ({"model_name_or_path": "m", "num_train_epochs": 2.5}, ["num_train_epochs"]),  # rounded up, said so
    ({"model_name_or_path": "m", "dataset_name": "HuggingFaceH4/ultrachat_200k"}, []),  # input.hf
    ({"base_model": "m", "adapter": "lora", "rl": "dpo", "dpo_beta": 0.05,
      "datasets": [{"path": "Intel/orca_dpo_pairs", "split": "train", "type": "chatml.intel"}]}, ["datasets[0].type"]),
    ({"base_model": "m", "adapter": "lora", "rl": "kto"}, ["rl"]),  # a preference loss not offered
    ({"model_name_or_path": "m", "beta": 0.2, "loss_type": "ipo", "rpo_alpha": 1.0}, ["loss_type", "rpo_alpha"]),
    ({"model_name_or_path": "m", "load_in_4bit": True, "max_steps": -1}, []),  # qlora; -1 is "unset"
    ({"base_model": "m", "adapter": "qlora", "datasets": [{"path": "a.jsonl", "type": "alpaca"}, {"path": "b.jsonl"}]},
     ["datasets[0].type", "datasets[1]"]),
])
def test_each_field_not_honoured_is_named(capsys, tmp_path, config, named):
    source = tmp_path / "config.json"
    source.write_text(json.dumps(config))
    text, notes = convert(capsys, tmp_path / "out", source)
    assert [line.split(":", 1)[0] for line in notes] == named
    spec = parse_spec(text)
    if config.get("load_in_4bit") or config.get("adapter") == "qlora":
        assert spec.method == "qlora"
    if "HuggingFaceH4" in str(config) or "Intel" in str(config):  # a Hub name: input.hf, input.dataset left out
        assert spec.input.hf in ("HuggingFaceH4/ultrachat_200k", "Intel/orca_dpo_pairs") and not spec.input.dataset
    if config.get("rl") == "dpo" or "beta" in config:
        assert (spec.type, spec.input.format, spec.dpo.beta) == ("dpo", "preference", config.get("dpo_beta", config.get("beta")))
    elif config.get("rl"):
        assert spec.type == "sft"


def test_a_trl_dpo_config_becomes_a_dpo_spec_that_trains(capsys, tmp_path, tiny_dir):
    from agent.train.preference import demo_preferences

    text, notes = convert(capsys, tmp_path, EXAMPLES / "trl_dpo.yaml")
    spec = parse_spec(text)
    assert (spec.type, spec.dpo.beta, spec.input.hf, spec.input.split, spec.input.dataset) == (
        "dpo", 0.1, "trl-lib/ultrafeedback_binarized", "train", "")
    assert (spec.training.learning_rate, spec.training.batch_size, spec.training.max_seq_len) == (5e-6, 4, 1024)
    assert [line.split(":", 1)[0] for line in notes] == ["max_prompt_length", "bf16/fp16/gradient_checkpointing"]
    # the converted spec trains the DPO loss, here on a local preference file and the tiny model
    write_chatml(tmp_path / "prefs.jsonl", demo_preferences(40, seed=3))
    local = spec_with_values(text, {("", "base_model"): str(tiny_dir), ("input", "hf"): None,
                                    ("input", "dataset"): str(tmp_path / "prefs.jsonl"),
                                    ("training", "learning_rate"): "0.005", ("training", "max_seq_len"): "64",
                                    ("training", "max_steps"): "4", ("training", "batch_size"): "2",
                                    ("proof", "checkpoint_every"): "2"})
    (tmp_path / "local.yml").write_text(local)
    code, _, err = run_cli(capsys, "train", "run", "--local", "--config", str(tmp_path / "local.yml"), "--output",
                           str(tmp_path / "run"), "--threads", "1", "--no-progress", "--json")
    assert code == 0, err
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 4 and 0 < result["final_loss"] < 1.0  # a DPO loss: log 2 at the start
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["objective"] == "dpo"


@pytest.mark.parametrize("content, fragments", [
    ("a: [1\n", ("config.yml:2", "not valid YAML or JSON")),
    ("- just\n- a list\n", ("expected a mapping of training settings", "got list")),
    ("", ("an empty file",)),
])
def test_a_file_that_is_no_config_is_one_line(capsys, tmp_path, content, fragments):
    source = tmp_path / "config.yml"
    source.write_text(content)
    code, _, err = run_cli(capsys, "train", "init", "--from", str(source), "--output", str(tmp_path / "out"))
    assert_one_line_error(code, err, str(source), *fragments)
    assert not (tmp_path / "out" / "infernet.train.yml").exists()  # nothing written


def test_a_missing_config_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", "init", "--from", str(tmp_path / "nope.yaml"), "--output", str(tmp_path))
    assert_one_line_error(code, err, "nope.yaml", "no such file")
