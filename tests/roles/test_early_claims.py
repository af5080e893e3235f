"""A claim heard before the coordinator's own election tick names it is granted when it takes over.

Each agent starts a job's election after its own ``grace_seconds``; a worker whose grace ended first
claims while the coordinator-to-be does not coordinate yet. That claim used to be dropped, and the
worker waited ``2 x claim_interval`` to claim again while a faster worker took every shard (the
coordinator-judged scenario failed so under load). Here the coordinator's grace is 3 s longer than
the workers' and a claim is not repeated for a minute: the workers' first claims must get leases.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from protocol import state as st
from protocol.election import elect
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_claims_heard_before_the_election_are_granted_on_take_over(tmp_path, tiny_model_dir):
    workers = 3
    overrides = {i: {"claim_interval": 30.0} for i in range(workers)}
    async with network(tmp_path, tiny_model_dir, workers=workers, overrides=overrides) as net:
        spec = fast_spec(shards=3, rounds=1)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"),
                                                            str(tiny_model_dir))
        coordinator_id = elect(terms.job_id(), [w.peer_id for w in net.workers])
        coordinator = next(w for w in net.workers if w.peer_id == coordinator_id)
        others = {w.peer_id for w in net.workers} - {coordinator_id}
        coordinator.config = replace(coordinator.config, grace_seconds=coordinator.config.grace_seconds + 3.0)
        started = trio.current_time()
        view = await net.submitter.submitter.announce(terms)

        def leased() -> set[str]:
            return {lease.worker for lease in view.leases.values()}

        # without the remembered claims no lease comes before 2 x claim_interval = 60 s
        await net.submitter.wait_for(lambda: others <= leased(), timeout=20)
        assert trio.current_time() - started < 20
        remembered = coordinator.coordinator
        assert not remembered._early.get(view.job_id)  # handed to take_over, not kept
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=60)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason


def test_remembered_claims_are_queued_in_the_order_the_workers_first_claimed():
    """A worker that repeats its claim before we take over keeps its place: the byzantine-adapter
    scenario's quick claimers (claim_interval 0.3 s) repeated theirs and went behind the slower
    workers' single claims when the latest claim set the order, so one of them never trained."""
    from types import SimpleNamespace

    from agent.roles.coordinator import CoordinatorRole

    now = [0.0]
    local = SimpleNamespace(clock=lambda: now[0], peer_id="me")
    tasks = SimpleNamespace(spawn_in_job=lambda job, fn, *args: True)
    role = CoordinatorRole(local, None, tasks, None, None, lambda: None)  # type: ignore[arg-type]
    state = SimpleNamespace(round=1, terminal=False, shards=(), phase=st.JobPhase.TRAINING)
    view = SimpleNamespace(job_id=b"j" * 32, state=state, coordination=SimpleNamespace(term=1))
    for t, worker in [(0.0, "w0"), (0.3, "w1"), (0.5, "w2"), (0.8, "w0"), (0.9, "w3"), (1.1, "w1")]:
        now[0] = t
        role._remember_early(view, SimpleNamespace(round=1, shard=0), worker)  # type: ignore[arg-type]
    queued: list[str] = []
    role._queue = lambda view, worker, rnd, shard: queued.append(worker)  # type: ignore[method-assign]
    now[0] = 2.0
    role.take_over(view)  # type: ignore[arg-type]
    assert queued == ["w0", "w1", "w2", "w3"]
