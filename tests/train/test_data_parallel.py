"""One worker, several devices: two gloo processes on the CPU train the same steps as one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from agent.train.replay import relative_l2


def _train(rank: int, world: int, init: str, config, shard, out: str) -> None:
    import torch.distributed as dist

    from agent.train.model import load_tokenizer
    from agent.train.run import load_shard, open_session, pad_token_id

    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        tokenizer = load_tokenizer(config.base_model)
        session = open_session(config, load_shard(config, tokenizer, shard).examples, pad_id=pad_token_id(tokenizer))
        losses = [session.step(step).loss for step in range(config.max_steps)]
        if rank == 0:
            from safetensors.torch import save_file

            save_file(session.adapter_tensors(), out, metadata={"losses": json.dumps(losses)})
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path, base_config, demo_files):
    config = base_config.with_(max_steps=4, dropout=0.0, micro_batch_size=2, threads=1)  # 8 samples: 4 micro-batches
    _train(0, 1, "", config, demo_files["shard0"], str(tmp_path / "single.pt"))
    mp.spawn(_train, args=(2, f"file://{tmp_path / 'rendezvous'}", config, demo_files["shard0"],
                           str(tmp_path / "ddp.pt")), nprocs=2, join=True)
    single, ddp = _read(tmp_path / "single.pt"), _read(tmp_path / "ddp.pt")
    assert ddp["losses"] == pytest.approx(single["losses"], rel=1e-6)
    drift = relative_l2(ddp["adapter"], single["adapter"])
    assert max(drift.values()) < 1e-5, max(drift.values())
    assert any(t.abs().max() > 0 for n, t in single["adapter"].items() if "lora_B" in n)  # it trained


def _read(path) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as handle:
        losses = json.loads(handle.metadata()["losses"])
    return {"adapter": load_file(str(path)), "losses": losses}
