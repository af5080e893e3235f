"""Shared fixtures for training tests: the tiny model, demo shards, one trained run.

The tiny model is built once per machine into the infernet cache (INFERNET_CACHE, default
~/.cache/infernet); everything else lives in pytest's temporary directories. Training uses one
thread: results are then exact across processes, and two cores shared with others stay usable.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.train.config import TrainConfig
from agent.train.data import split_dataset, write_chatml
from agent.train.run import TrainRequest, TrainResult, train_shard
from agent.train.tiny import demo_records, tiny_model

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model()


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory) -> dict[str, Path]:
    """Demo records split into validation and three shards, as ChatML files."""
    root = tmp_path_factory.mktemp("demo")
    records = demo_records(240, seed=1)
    split = split_dataset(len(records), 3, 0.15, seed=1)
    files = {"validation": root / "validation.jsonl"}
    write_chatml(files["validation"], [records[i] for i in split.validation])
    for j, indices in enumerate(split.shards):
        files[f"shard{j}"] = root / f"shard{j}.jsonl"
        write_chatml(files[f"shard{j}"], [records[i] for i in indices])
    return files


@pytest.fixture(scope="session")
def base_config(tiny_model_dir) -> TrainConfig:
    return TrainConfig(
        base_model=str(tiny_model_dir), seed=7, batch_size=8, learning_rate=1e-2, rank=8, alpha=16.0,
        dropout=0.05, target_modules=ALL_PROJECTIONS, checkpoint_every=10, max_steps=30, threads=1,
        log_every=10, max_seq_len=96,
    )


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, base_config, demo_files) -> tuple[TrainRequest, TrainResult, list]:
    """30 steps on shard 0 with validation: 3 checkpoints, the events the callback saw."""
    request = TrainRequest(base_config, demo_files["shard0"], tmp_path_factory.mktemp("run") / "run",
                           validation=demo_files["validation"], job_id=bytes(range(32)), round=1,
                           shard_index=0, worker="12D3KooWTestWorker")
    events: list = []
    result = train_shard(request, events.append)
    return request, result, events
