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


def test_a_claim_from_a_peer_not_heard_yet_is_queued_once_it_is_heard():
    """A coordinator that just restarted (or took over) refuses the claims of peers whose heartbeat or capability
    it has not heard yet; the claim is kept and queued at the tick that hears them, not lost: the worker claimed
    its early start once in the term and dropped that work 20 s later, unleased (tests/roles/test_resume.py)."""
    from types import SimpleNamespace

    from agent.peers import PeerTable
    from agent.roles.coordinator import CoordinatorRole
    from protocol import messages as m
    from scripts.make_envelope_vectors import sample_capability

    now = [100.0]
    table = PeerTable("me", lambda: now[0], heartbeat_seconds=1.0, missed_heartbeats=3, ours=lambda: None)
    table.is_coordinator = lambda view: True  # type: ignore[method-assign] - (the election is tested elsewhere)
    local = SimpleNamespace(clock=lambda: now[0], peer_id="me")
    tasks = SimpleNamespace(spawn_in_job=lambda job, fn, *args: True)
    role = CoordinatorRole(local, table, tasks, None, None, lambda: None)  # type: ignore[arg-type]
    heard = lambda w: w in table.live_peers() and table.capability_of(w) is not None  # noqa: E731
    role._may_lease = lambda view, rnd, worker, count=True: heard(worker)  # type: ignore[method-assign]
    state = SimpleNamespace(round=2, terminal=False, shards=(), phase=st.JobPhase.TRAINING)
    view = SimpleNamespace(job_id=b"j" * 32, state=state, verdicts={}, coordination=SimpleNamespace(term=1))

    role._queue(view, "w1", 2, 1)  # type: ignore[arg-type]  - w1 never heard: kept
    table.heard("w2", m.Heartbeat(1, 0, ()), now[0])
    role._queue(view, "w2", 2, 0)  # type: ignore[arg-type]  - w2 heard, its capability not: kept
    role._queue(view, "w3", 1, 0)  # type: ignore[arg-type]  - a round that is over: not kept
    queued = role._claims.setdefault(view.job_id, [])  # (what _grant_claims takes, in order)
    assert set(role._unheard[view.job_id]) == {"w1", "w2"} and not queued
    now[0] += 0.5
    role.grant_heard(view, now[0])  # type: ignore[arg-type]
    assert not queued  # nothing heard meanwhile
    table.told("w2", sample_capability(), now[0])
    table.heard("w2", m.Heartbeat(2, 0, ()), now[0])
    role.grant_heard(view, now[0])  # type: ignore[arg-type]
    assert [q[0] for q in queued] == ["w2"] and set(role._unheard[view.job_id]) == {"w1"}
    now[0] += role.unheard_claim_seconds
    table.told("w1", sample_capability(), now[0])
    table.heard("w1", m.Heartbeat(1, 0, ()), now[0])
    role.grant_heard(view, now[0])  # type: ignore[arg-type]
    assert [q[0] for q in queued] == ["w2"] and not role._unheard[view.job_id]  # kept too long: dropped
