"""Real agents on loopback for role tests: in one trio run, each with its own identity and home."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from agent.node import Agent, AgentConfig
from agent.train.data import write_chatml
from agent.train.tiny import demo_records, tiny_model
from protocol.identity import Identity

pytestmark = pytest.mark.network

MODEL_NAME = "infernet-tiny"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model()


def write_dataset(path: Path, n: int = 160) -> Path:
    write_chatml(path, demo_records(n, seed=5))
    return path


def fast_spec(shards: int = 4, rounds: int = 2, max_retries: int = 4, lease_seconds: int = 60, max_steps: int = 8):
    """A small job the tiny model trains in about a second per shard (jobspec defaults otherwise)."""
    from protocol.jobspec import parse_spec

    text = f"""
name: role-test
base_model: {MODEL_NAME}
seed: 3
input: {{dataset: demo.jsonl, validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: {max_steps}, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: {shards}
rounds: {rounds}
max_retries: {max_retries}
proof: {{checkpoint_every: 4, verify_segments: 1, tolerance: 0.0001}}
lease_seconds: {lease_seconds}
"""
    return parse_spec(text, "test-spec")


@dataclass
class LoopbackNet:
    submitter: Agent
    workers: list[Agent]
    nursery: trio.Nursery
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    def kill(self, agent: Agent) -> None:
        """Stop an agent abruptly: no release, no goodbye (its connections just close)."""
        self.scopes[agent.peer_id].cancel()

    async def restart(self, agent: Agent) -> Agent:
        """Start a new Agent with the identity and home of a stopped one (it resumes from its store).

        A cancelled agent in this process leaves its sockets open (a dead process's would be closed by
        the OS), and its peers would keep using them for the new agent, which has the same peer ID:
        they drop those connections first.
        """
        from agent.net.host import to_libp2p_id

        for other in [self.submitter, *self.alive()]:
            if other.peer_id != agent.peer_id:
                with trio.move_on_after(5):
                    await other.net.host.libp2p.disconnect(to_libp2p_id(agent.peer_id))
        again = Agent(agent.identity, agent.config)
        self.scopes[again.peer_id] = trio.CancelScope()
        await self.nursery.start(_run, again, self.scopes[again.peer_id])
        self.workers[self.workers.index(agent)] = again
        return again

    def alive(self) -> list[Agent]:
        return [a for a in self.workers if not self.scopes[a.peer_id].cancel_called]


async def _run(agent: Agent, scope: trio.CancelScope, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        await agent.run(task_status=task_status)


@asynccontextmanager
async def network(tmp_path: Path, model_dir: Path, workers: int = 3, *,
                  misbehave: dict[int, str] | None = None,
                  overrides: dict[int, dict] | None = None) -> AsyncIterator[LoopbackNet]:
    """A submitter (bootstrap, never a coordinator) and ``workers`` training agents.

    Misbehaving workers never coordinate: a Byzantine coordinator is another test's subject.
    """
    misbehave = misbehave or {}
    models = ((MODEL_NAME, str(model_dir)),)
    async with trio.open_nursery() as nursery:
        submitter = Agent(Identity.generate(), AgentConfig(home=tmp_path / "submitter", can_coordinate=False,
                                                           models=models))
        net = LoopbackNet(submitter, [], nursery)
        net.scopes[submitter.peer_id] = trio.CancelScope()
        await nursery.start(_run, submitter, net.scopes[submitter.peer_id])
        bootstrap = (submitter.addrs()[0],)
        for i in range(workers):
            config = AgentConfig(home=tmp_path / f"worker{i}", bootstrap=bootstrap, accept_training=True,
                                 models=models, misbehave=misbehave.get(i), can_coordinate=i not in misbehave,
                                 **(overrides or {}).get(i, {}))
            agent = Agent(Identity.generate(), config)
            net.scopes[agent.peer_id] = trio.CancelScope()
            await nursery.start(_run, agent, net.scopes[agent.peer_id])
            net.workers.append(agent)
        honest = workers - len(misbehave)
        with trio.fail_after(30):  # everyone knows everyone (heartbeats) before a job is announced
            while any(len(a.eligible_coordinators()) < honest for a in [submitter, *net.workers]):
                await trio.sleep(0.2)
        try:
            yield net
        finally:
            nursery.cancel_scope.cancel()
