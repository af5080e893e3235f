"""infernet infer: real peft generation with the tiny model and a trained adapter; one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from agent.pipeline.infer import GenerationOptions, generate, load_model
from agent.pipeline.source import PipelineError, resolve_source
from tests.pipeline.conftest import assert_one_line_error, run_cli

GREEDY = GenerationOptions(temperature=0.0, max_new_tokens=16)


def test_samples_from_the_runs_validation_split_as_json(capsys, run_dir):
    code, out, _ = run_cli(capsys, "infer", str(run_dir), "--samples", "3", "--temperature", "0", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["adapter"] == str(run_dir / "checkpoint-final") and len(doc["results"]) == 3
    validation = (run_dir / "data" / "validation.jsonl").read_text()
    for item in doc["results"]:
        assert item["messages"][-1]["role"] == "user" and item["messages"][-1]["content"] in validation
        assert item["expected"] in validation and isinstance(item["output"], str)
    again = json.loads(run_cli(capsys, "infer", str(run_dir), "--samples", "3", "--temperature", "0", "--json")[1])
    assert [r["output"] for r in again["results"]] == [r["output"] for r in doc["results"]]


def test_the_adapter_changes_what_the_model_says_and_the_answer_streams(run_dir):
    source = resolve_source(str(run_dir))
    model, tokenizer = load_model(source)
    messages = [{"role": "user", "content": "Translate to French: cat"}]
    pieces: list[str] = []
    answer = generate(model, tokenizer, messages, GREEDY, on_text=pieces.append)
    assert answer and "".join(pieces).strip() == answer
    with model.disable_adapter():
        base_answer = generate(model, tokenizer, messages, GREEDY)
    assert answer != base_answer
    sampled = [generate(model, tokenizer, messages, GenerationOptions(temperature=1.0, seed=s, max_new_tokens=8))
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # same seed, same text


def test_prompt_prints_the_question_and_the_streamed_answer(capsys, run_dir):
    code, out, err = run_cli(capsys, "infer", str(run_dir), "--prompt", "Spell the word cat.", "--temperature", "0",
                             "--max-new-tokens", "8", "--system", "Answer briefly.")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "> Spell the word cat." and len(lines) >= 2


def test_an_adapter_directory_finds_its_base_and_a_wrong_base_is_refused(capsys, tmp_path, run_dir, tiny_dir):
    adapter = tmp_path / "adapter"
    shutil.copytree(run_dir / "checkpoint-final", adapter)
    source = resolve_source(str(adapter))
    assert source.base_dir == tiny_dir and source.provenance.kind == "adapter"
    # a base of another shape: the adapter's tensors fit none of its modules
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = tmp_path / "other-base"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, other / name)
    code, _, err = run_cli(capsys, "infer", str(adapter), "--base", str(other), "--prompt", "hi")
    assert_one_line_error(code, err, "adapter/base mismatch", "does not fit")
    # the run's proof names its base model's hash: another tiny model (seed 1) is refused before loading
    from agent.train.tiny import tiny_model

    code, _, err = run_cli(capsys, "infer", str(run_dir), "--base", str(tiny_model(seed=1)), "--prompt", "hi")
    assert_one_line_error(code, err, "adapter/base mismatch", "sha256")


@pytest.mark.parametrize("source, fragment", [
    ("no/such/run", "no such directory, and not a job ID"),
    ("bafkreiduzq5cbfx5rij!!", "bad CID"),
    ("bafkreiduzq5cbfx5rijzq3xjts7qr6aoa4nbzhwh746cvjik24ckqxyhwu", "a CID; give the job ID"),
])
def test_bad_sources_are_one_line(capsys, source, fragment):
    code, _, err = run_cli(capsys, "infer", source, "--prompt", "hi")
    assert_one_line_error(code, err, fragment)


def test_a_job_id_needs_the_running_agent_and_bad_options_are_one_line(capsys, tmp_path, run_dir):
    code, _, err = run_cli(capsys, "infer", "abcd1234", "--home", str(tmp_path / "home"), "--prompt", "hi")
    assert_one_line_error(code, err, "no agent is running")
    code, _, err = run_cli(capsys, "infer", str(run_dir / "data"), "--prompt", "hi")
    assert_one_line_error(code, err, "neither a run directory")
    code, _, err = run_cli(capsys, "infer", str(run_dir), "--top-p", "0", "--prompt", "hi")
    assert_one_line_error(code, err, "--top-p")
    code, _, err = run_cli(capsys, "infer", str(run_dir / "checkpoint-final"), "--samples", "2")
    assert_one_line_error(code, err, "--dataset")


def test_adapter_mismatch_check_names_the_module(run_dir, tiny_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agent.pipeline.infer import adapter_mismatches

    base = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    tensors = load_file(str(run_dir / "checkpoint-final" / "adapter_model.safetensors"))
    assert adapter_mismatches(base, tensors) == []
    name = next(k for k in tensors if ".lora_B." in k)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    assert adapter_mismatches(base, tensors)[0].startswith(name)


def test_source_errors_are_pipeline_errors(tmp_path):
    with pytest.raises(PipelineError, match="a file"):
        (tmp_path / "f").write_text("x")
        resolve_source(str(tmp_path / "f"))


@pytest.mark.slow
def test_chat_on_a_terminal_keeps_the_conversation_until_exit(run_dir):
    import os
    import pty
    import subprocess
    import sys
    import time

    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "agent.cli", "infer", str(run_dir), "--temperature", "0",
                                "--max-new-tokens", "8"], stdin=slave, stdout=slave, stderr=slave,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    os.close(slave)
    screen = b""

    def read_until_prompt(count: int) -> None:
        nonlocal screen
        deadline = time.monotonic() + 120
        while screen.count(b"you> ") < count:
            assert time.monotonic() < deadline, screen
            screen += os.read(master, 4096)

    read_until_prompt(1)
    os.write(master, b"Spell the word cat.\n")
    read_until_prompt(2)
    os.write(master, b"/exit\n")
    assert process.wait(timeout=60) == 0
    os.close(master)
    text = screen.decode(errors="replace")
    assert "chat with the model" in text and "model> " in text
