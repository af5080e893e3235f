"""Real agents on loopback for role tests: in one trio run, each with its own identity and home."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from agent.node import Agent, AgentConfig
from agent.train.tiny import tiny_model
from protocol.identity import Identity

pytestmark = pytest.mark.network

MODEL_NAME = "infernet-tiny"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model()


def fast_spec(**overrides):
    """A small job the tiny model trains in seconds (jobspec defaults otherwise)."""
    from protocol.jobspec import parse_spec

    text = f"""
name: role-test
base_model: {MODEL_NAME}
seed: 3
input: {{dataset: demo.jsonl, validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: 8, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: {overrides.pop('shards', 4)}
rounds: {overrides.pop('rounds', 2)}
max_retries: {overrides.pop('max_retries', 2)}
proof: {{checkpoint_every: 4, verify_segments: 1, tolerance: 0.0001}}
lease_seconds: {overrides.pop('lease_seconds', 60)}
"""
    return parse_spec(text, "test-spec")


@asynccontextmanager
async def network(tmp_path: Path, model_dir: Path, workers: int = 3, *,
                  misbehave: dict[int, str] | None = None) -> AsyncIterator[tuple[Agent, list[Agent], trio.Nursery]]:
    """A submitter (bootstrap, not a coordinator) and ``workers`` training agents."""
    misbehave = misbehave or {}
    models = ((MODEL_NAME, str(model_dir)),)
    async with trio.open_nursery() as nursery:
        submitter = Agent(Identity.generate(), AgentConfig(home=tmp_path / "submitter", can_coordinate=False,
                                                           models=models))
        await nursery.start(submitter.run)
        bootstrap = (submitter.addrs()[0],)
        pool = []
        for i in range(workers):
            config = AgentConfig(home=tmp_path / f"worker{i}", bootstrap=bootstrap, accept_training=True,
                                 models=models, misbehave=misbehave.get(i))
            agent = Agent(Identity.generate(), config)
            await nursery.start(agent.run)
            pool.append(agent)
        # every agent must know every other one (heartbeats) before a job is announced
        with trio.fail_after(30):
            while any(len(a.eligible_coordinators()) < workers for a in [submitter, *pool]):
                await trio.sleep(0.2)
        try:
            yield submitter, pool, nursery
        finally:
            nursery.cancel_scope.cancel()
