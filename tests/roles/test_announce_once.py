"""An interactive announce (issue 23 step 4): `job announce` at a terminal asks the agent for an estimate, then
for the announce; the agent reads the spec and reads, checks and splits the dataset once for both. A dataset
changed in between is read again."""

from __future__ import annotations

import os

import pytest

from agent import control
from agent.train.data import write_chatml
from agent.train.tiny import demo_records
from tests.roles.conftest import network

pytestmark = pytest.mark.network

SPEC = """name: once
base_model: {model}
input: {{dataset: data.jsonl, validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: 4, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: 2
proof: {{checkpoint_every: 2, verify_segments: 1}}
"""


async def test_an_estimate_then_an_announce_read_the_spec_and_split_the_dataset_once(tmp_path, tiny_model_dir):
    write_chatml(tmp_path / "data.jsonl", demo_records(60, seed=2))
    (tmp_path / "spec.yml").write_text(SPEC.format(model=tiny_model_dir))
    spec = str(tmp_path / "spec.yml")
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        estimate = await control.HANDLERS["job.estimate"](submitter, spec)
        assert estimate["records"] == 60 and estimate["shards"] == 2 and estimate["steps"] > 0
        announced = await control.HANDLERS["job.announce"](submitter, spec)
        assert announced["shards"] == 2
        assert (submitter.counters["spec_reads"], submitter.counters["dataset_plans"]) == (1, 1)
        # the dataset changed since (a new mtime): read and split again, never a stale plan
        write_chatml(tmp_path / "data.jsonl", demo_records(80, seed=3))
        os.utime(tmp_path / "data.jsonl", ns=(1, 10**18))
        again = await control.HANDLERS["job.estimate"](submitter, spec)
        assert again["records"] == 80 and submitter.counters["dataset_plans"] == 2
