"""A full fine-tuning run through the pipeline (issue 26 step 3): `train run --local` with method: full, then
`infer` and `publish --merged` read its weights (not a LoRA adapter), and the merged model is those weights."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from agent.train.data import write_chatml
from agent.train.tiny import demo_records
from tests.pipeline.conftest import run_cli


def test_a_full_run_is_tried_and_published_as_its_own_weights(capsys, tmp_path, tiny_dir):
    write_chatml(tmp_path / "train.jsonl", demo_records(60, seed=4))
    (tmp_path / "spec.yml").write_text(
        f"name: full-local\nbase_model: {tiny_dir}\nmethod: full\ninput: {{dataset: train.jsonl}}\n"
        "training: {learning_rate: 0.001, batch_size: 4, max_steps: 4, max_seq_len: 64}\nproof: {checkpoint_every: 2}\n")
    code, out, err = run_cli(capsys, "train", "run", "--local", "--config", str(tmp_path / "spec.yml"), "--output",
                             str(tmp_path / "run"), "--threads", "1", "--no-progress")
    assert code == 0, err
    assert "weights: " in out and "Full fine-tuning run" in (tmp_path / "run" / "README.md").read_text()
    assert json.loads((tmp_path / "run" / "checkpoint-final" / "adapter_config.json").read_text())["infernet_method"] == "full"
    code, out, err = run_cli(capsys, "infer", str(tmp_path / "run"), "--prompt", "What color is the sky?",
                             "--temperature", "0", "--max-new-tokens", "8")
    assert code == 0 and out.strip(), err
    code, out, err = run_cli(capsys, "publish", str(tmp_path / "run"), "--merged", str(tmp_path / "merged"))
    assert code == 0, err
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    trained = load_file(str(tmp_path / "run" / "checkpoint-final" / "adapter_model.safetensors"))
    base = load_file(str(tiny_dir / "model.safetensors"))
    assert all(torch.equal(merged[name], tensor) for name, tensor in trained.items())
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
