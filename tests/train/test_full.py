"""Full fine-tuning (issue 26 step 3): every weight of a small base model trains, its state is hashed and
replayed like an adapter's, the result becomes a model directory transformers loads, and a model past the
protocol's size limit is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agent.train.config import TrainError
from agent.train.model import (
    FULL_MARKER_FILE, as_model_dir, model_refusal, parameters_on_disk,
)
from agent.train.replay import verify_segment
from agent.train.run import POOL, TrainRequest, train_shard
from protocol.fit import full_size_refusal
from protocol.messages import FULL_MAX_PARAMETERS
from protocol.proof import Commitment


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, base_config, demo_files):
    config = base_config.with_(method="full", freeze_a=False, learning_rate=1e-3, dropout=0.0, max_steps=16,
                               checkpoint_every=8)
    request = TrainRequest(config, demo_files["shard0"], tmp_path_factory.mktemp("full") / "run",
                           validation=demo_files["validation"], job_id=bytes(range(32)), worker="12D3KooWTestWorker")
    return request, train_shard(request)


def test_every_weight_trains_and_the_validation_loss_falls(full_run, tiny_model_dir):
    request, result = full_run
    assert result.validation_loss < result.initial_validation_loss - 2.0, result
    weights = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(weights) == set(base) and sum(w.numel() for w in weights.values()) == parameters_on_disk(tiny_model_dir)
    assert all(not torch.equal(weights[name], base[name]) for name in weights if name.endswith("proj.weight"))
    assert json.loads((result.adapter_dir / "adapter_config.json").read_text())["infernet_method"] == "full"
    assert "lora_" not in " ".join(load_file(str(request.run_dir / "checkpoints" / "step-000008" /
                                                 "optimizer.safetensors")))


def test_a_full_segment_replays_on_the_same_bits(full_run):
    request, result = full_run
    commitment = Commitment.from_json(json.loads((request.run_dir / "proof.json").read_text()))
    verdict = verify_segment(commitment, 1, start=request.run_dir / "checkpoints" / "step-000008",
                             shard=request.shard, config=request.config, claimed_head=result.head)
    assert verdict.accepted and verdict.exact, verdict
    # the same start replayed as a LoRA job is another model: refused, not a crash
    lora = verify_segment(commitment, 1, start=request.run_dir / "checkpoints" / "step-000008",
                          shard=request.shard, config=request.config.with_(method="lora"))
    assert not lora.accepted and "does not fit the model" in lora.reason, lora


def test_the_fetched_weights_become_a_model_directory_transformers_loads(full_run, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, result = full_run
    out = tmp_path / "model"
    out.mkdir()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (out / name).write_bytes((result.adapter_dir / name).read_bytes())
    as_model_dir(out, tiny_model_dir)
    assert (out / FULL_MARKER_FILE).exists() and not (out / "adapter_model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    trained = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in trained.items())
    assert AutoTokenizer.from_pretrained(str(out)).chat_template  # the base model's tokenizer came along


def test_a_base_model_past_the_size_limit_is_refused_in_one_line(tiny_model_dir, base_config, monkeypatch):
    assert full_size_refusal(FULL_MAX_PARAMETERS) is None
    refusal = full_size_refusal(FULL_MAX_PARAMETERS + 1)
    assert refusal.startswith("method full: the base model has 80M parameters, more than the 80M") and "\n" not in refusal
    assert model_refusal("full", ("nope",), tiny_model_dir) is None  # target_modules do not matter to full
    assert "not a linear layer" in model_refusal("lora", ("nope",), tiny_model_dir)
    # the tiny model (about 1M parameters) against a limit below it: refused at announce and at the build
    monkeypatch.setattr("protocol.fit.FULL_MAX_PARAMETERS", 100_000)
    assert "more than the 0M full fine-tuning allows" in model_refusal("full", (), tiny_model_dir)
    POOL.clear()
    from agent.train.run import build_lora_model

    with pytest.raises(TrainError, match="more than the 0M full fine-tuning allows"):
        build_lora_model(base_config.with_(method="full", freeze_a=False), "cpu", torch.float32, "peft")
