"""QLoRA: 4-bit NF4 base (bitsandbytes) with a LoRA on top, trained on CPU like the GPU path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agent.train.replay import verify_segment
from agent.train.run import TrainRequest, train_shard
from protocol.proof import Commitment

pytest.importorskip("bitsandbytes")


def test_qlora_trains_and_proves(tmp_path, base_config, demo_files):
    config = base_config.with_(method="qlora", max_steps=6, checkpoint_every=3, batch_size=4, log_every=3)
    result = train_shard(TrainRequest(config, demo_files["shard1"], tmp_path / "run",
                                      validation=demo_files["validation"]))
    assert result.checkpoints == 2
    assert result.validation_loss < result.initial_validation_loss
    adapter = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for n, t in adapter.items() if ".lora_B." in n)
    assert all(t.dtype == torch.float32 for t in adapter.values())
    commitment = Commitment.from_json(json.loads((result.run_dir / "proof.json").read_text()))
    verdict = verify_segment(commitment, 1, start=result.run_dir / "checkpoints" / "step-000003",
                             shard=demo_files["shard1"], config=config)
    assert verdict.accepted and verdict.exact, verdict


def test_qlora_base_is_really_4bit(base_config):
    import bitsandbytes as bnb

    from agent.train.run import build_lora_model

    model = build_lora_model(base_config.with_(method="qlora"), "cpu", torch.float32, "peft")
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 4 * 7
    assert all(m.weight.dtype == torch.uint8 for m in quantized)
