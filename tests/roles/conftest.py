"""Real agents on loopback for role tests: the harness's network (agent/harness/network.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.harness.network import MODEL_NAME, network as _network
from agent.train.data import write_chatml
from agent.train.tiny import demo_records, tiny_model

pytestmark = pytest.mark.network


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model()


def write_dataset(path: Path, n: int = 160) -> Path:
    write_chatml(path, demo_records(n, seed=5))
    return path


def fast_spec(shards: int = 4, rounds: int = 2, max_retries: int = 4, lease_seconds: int = 60, max_steps: int = 8,
              extra: str = "", training: str = "", verify_segments: int = 1):
    """A small job the tiny model trains in about a second per shard (jobspec defaults otherwise)."""
    from protocol.jobspec import parse_spec

    text = f"""
name: role-test
base_model: {MODEL_NAME}
seed: 3
input: {{dataset: demo.jsonl, validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: {max_steps}, max_seq_len: 96{training}}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: {shards}
rounds: {rounds}
max_retries: {max_retries}
proof: {{checkpoint_every: 4, verify_segments: {verify_segments}, tolerance: 0.0001}}
lease_seconds: {lease_seconds}
{extra}"""
    return parse_spec(text, "test-spec")


def network(tmp_path: Path, model_dir: Path, workers: int = 3, **kwargs):
    """A submitter and ``workers`` training agents under ``tmp_path`` (see agent.harness.network.network)."""
    return _network(tmp_path, model_dir, workers, **kwargs)
