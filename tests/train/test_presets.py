"""Micro-batch from free VRAM (declared sizes), the effective batch kept; presets; exact replay of a split run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from agent.train.presets import ModelShape, apply_preset, plan_batches
from agent.train.replay import relative_l2, verify_segment
from agent.train.run import TrainRequest, train_shard
from protocol.proof import Commitment

QWEN25_05B = ModelShape(hidden=896, intermediate=4864, layers=24, vocab=151936, tied=True)
QWEN25_7B = ModelShape(hidden=3584, intermediate=18944, layers=28, vocab=152064, tied=False)


@pytest.mark.parametrize("free_gb, micro", [(80.0, 32), (16.0, 4), (8.0, 2), (5.0, 1)])
def test_micro_batch_grows_with_free_vram_and_keeps_the_effective_batch(free_gb, micro):
    plan = plan_batches(32, free_gb, QWEN25_05B, seq_len=512)
    assert (plan.micro_batch, plan.accumulation) == (micro, 32 // micro)
    assert plan.micro_batch * plan.accumulation == 32 and plan.fits
    assert plan.estimate_gb <= free_gb


def test_a_model_that_does_not_fit_is_said_so_and_qlora_needs_less():
    assert not plan_batches(8, 3.0, QWEN25_05B, seq_len=512).fits
    lora = plan_batches(8, 24.0, QWEN25_7B, seq_len=1024, method="lora")
    qlora = plan_batches(8, 24.0, QWEN25_7B, seq_len=1024, method="qlora")
    assert not lora.fits  # 7B in bf16 (15 GB of weights) + a 1024-token sample exceed 24 GB * 0.85
    assert qlora.fits and qlora.micro_batch == 1 and qlora.accumulation == 8
    assert plan_batches(12, 80.0, QWEN25_7B, seq_len=512, method="qlora").micro_batch in (6, 12)  # divisors only


def test_presets(base_config, tiny_model_dir):
    quick = apply_preset(base_config.with_(max_steps=0, max_seq_len=1024), "quick-test", free_vram_gb=None,
                         model_dir=tiny_model_dir)
    assert quick.max_steps == 20 and quick.checkpoint_every == 10 and quick.max_seq_len == 256
    cpu = apply_preset(base_config, "auto", free_vram_gb=None, model_dir=tiny_model_dir)
    assert cpu.micro_batch == base_config.batch_size  # CPU: the job's split, so replays stay exact
    gpu = apply_preset(base_config.with_(batch_size=4, gradient_accumulation_steps=4), "auto", free_vram_gb=2.0,
                       model_dir=tiny_model_dir)
    assert gpu.micro_batch == 16 and gpu.samples_per_step == 16  # the tiny model fits whole in 2 GB
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        apply_preset(base_config, "fast", free_vram_gb=None, model_dir=tiny_model_dir)


def test_a_worker_chosen_micro_batch_keeps_the_proof_and_replays_exactly(tmp_path, base_config, demo_files):
    # on the CPU in float32 whatever the machine has: that is where a replay is exact (bf16 on a GPU is not,
    # IPIP-0005 §8.1), and where micro-batches sum to the whole step within float32 noise
    config = base_config.with_(max_steps=6, checkpoint_every=3, dropout=0.0, device="cpu", dtype="float32")
    whole = train_shard(TrainRequest(config, demo_files["shard0"], tmp_path / "whole"))
    split = train_shard(TrainRequest(config.with_(micro_batch_size=2), demo_files["shard0"], tmp_path / "split"))
    a = Commitment.from_json(json.loads((whole.run_dir / "proof.json").read_text()))
    b = Commitment.from_json(json.loads((split.run_dir / "proof.json").read_text()))
    assert [l.batches_digest for l in a.links] == [l.batches_digest for l in b.links]  # the same samples per step
    assert b.header.environment["micro_batch"] == 2 and a.header.environment["micro_batch"] == 8
    for x, y in zip(a.links, b.links):
        assert y.loss == pytest.approx(x.loss, rel=1e-5)  # the same token-weighted mean
    drift = relative_l2(load_file(str(split.adapter_dir / "adapter_model.safetensors")),
                        load_file(str(whole.adapter_dir / "adapter_model.safetensors")))
    assert max(drift.values()) < 1e-4
    # the verifier runs the job's config (batch 8) but replays with the header's split: exact
    verdict = verify_segment(b, 1, start=split.run_dir / "checkpoints" / "step-000003", shard=demo_files["shard0"],
                             config=config)
    assert verdict.accepted and verdict.exact, verdict
    assert torch.get_num_threads() >= 1
