"""Issue #15 items 5 and 6: the store keeps what changed the mirror, in the order it did; history sync
serves decisions first under its limits; hashing and store commits run off the event loop.

Real parts: a real Agent (not started on the network) with a real SQLite store, fed real signed
envelopes through the code path of the job topic's reader (``Agent.on_job_message``).
"""

from __future__ import annotations

import pytest
import trio

from agent.net.gossip import Received
from agent.node import Agent, AgentConfig, PeerInfo
from protocol.mirror import PENDING_MAX, PENDING_PER_SIGNER, JobMirror
from agent.roles.sync import history_for
from agent.store import Store
from protocol import messages as m
from protocol import state as st
from protocol.election import Coordination
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_capability, sample_terms

SUBMITTER, COORD, W1, W2, OBSERVER = (Identity(bytes([i]) * 32) for i in (1, 30, 31, 32, 33))
TERMS = sample_terms(SUBMITTER)
JOB = TERMS.job_id()
NOW = 1_790_000_000.0


def received(identity: Identity, message, at: float) -> Received:
    data = seal(identity, message, now=at)
    opened = open_envelope(data, now=at)
    return Received(m.job_topic(JOB), opened.message, opened.envelope, identity.peer_id)


def observer_agent(tmp_path) -> tuple[Agent, JobMirror]:
    """An agent that follows the job (not its submitter, not a worker), its store open, not on a network."""
    agent = Agent(OBSERVER, AgentConfig(home=tmp_path, can_coordinate=False), clock=lambda: NOW)
    agent.store = Store.in_data_dir(tmp_path, OBSERVER)
    agent.store.add_job(TERMS, "observer", NOW)
    agent.peers[COORD.peer_id] = PeerInfo(NOW, capability=sample_capability())
    view = JobMirror(TERMS, NOW, OBSERVER.peer_id)
    view.coordination = Coordination(JOB, 1, COORD.peer_id)
    agent.jobs[JOB] = view
    return agent, view


def report(shard: int, attempt: int) -> m.ShardReport:
    cid = TERMS.shards[shard].cid
    return m.ShardReport(JOB, 1, shard, attempt, cid, cid, bytes(32), 1, 4, 32, 1.0, {})


def test_a_flood_of_well_signed_messages_that_do_not_apply_is_not_stored_and_does_not_crowd_out_history(tmp_path):
    agent, view = observer_agent(tmp_path)
    real = [
        received(COORD, m.ShardLease(JOB, 1, 0, 1, W1.peer_id, 1, NOW + 120, None), NOW + 1),
        received(W1, m.CheckpointCommit(JOB, 1, 0, 1, 4, 0, bytes(32), bytes(32), 1.5, None), NOW + 2),
        received(W1, report(0, 1), NOW + 3),
    ]
    # a held verdict (it arrives before the report it judges): kept in memory, stored once it applies
    held = received(COORD, m.Verdict(JOB, 1, 0, 1, W1.peer_id, 1, True, "ok", (0,)), NOW + 2.5)
    sybils = [Identity(bytes([100 + i]) * 32) for i in range(12)]
    flood = [received(s, report(1, 1 + k), NOW + 2 + k / 100) for s in sybils for k in range(PENDING_PER_SIGNER + 2)]

    async def main() -> None:
        await agent.on_job_message(view, real[0])
        await agent.on_job_message(view, real[1])
        await agent.on_job_message(view, held)
        for r in flood:  # valid signatures, the job's ID, but none holds a lease: nothing applies
            await agent.on_job_message(view, r)
        await agent.on_job_message(view, real[2])

    trio.run(main)
    assert view.shard(0).phase is st.ShardPhase.ACCEPTED
    stored = [s.data for s in agent.store.envelopes(JOB, stored_order=True)]
    expected = [r.envelope.to_bytes() for r in (*real, held)]
    assert stored == expected, "only what applied is stored, in the order it applied (the verdict after its report)"
    assert history_for(agent.store, JOB) == expected
    # what is held is bounded per signer and in all, and the held verdict was never pushed out by the flood
    assert len(view.pending) <= PENDING_MAX
    assert max(sum(1 for p in view.pending if p[2] == s.peer_id) for s in sybils) <= PENDING_PER_SIGNER
    assert view.refused["pending-signer-quota"] > 0 and view.refused["pending-overflow"] > 0
    # a restart rebuilds the same mirror from that store
    rebuilt = agent.rebuild_view(agent.store.job(JOB))
    assert rebuilt.state == view.state
    agent.store.close()


def test_the_strangers_held_messages_go_first_when_the_held_set_is_full():
    view = JobMirror(TERMS, NOW, SUBMITTER.peer_id)
    view.coordination = Coordination(JOB, 1, COORD.peer_id)
    eligible = frozenset({COORD.peer_id})
    early = m.Verdict(JOB, 1, 1, 1, W2.peer_id, 1, True, "ok", (0,))  # before the lease and report it follows
    assert view.receive(early, COORD.peer_id, NOW, eligible).actions is None
    for i in range(PENDING_MAX + 50):
        stranger = Identity((1000 + i).to_bytes(2, "big") * 16)
        view.receive(report(1, 1), stranger.peer_id, NOW + 1, eligible)
    assert len(view.pending) == PENDING_MAX
    assert any(p[1] == early for p in view.pending), "the coordinator's held verdict survived the flood"


def test_history_over_the_limit_sends_decisions_and_reports_before_checkpoints(tmp_path):
    store = Store.in_data_dir(tmp_path, SUBMITTER)
    sealed = [seal(COORD, m.ShardLease(JOB, 1, 0, 1, W1.peer_id, 1, NOW + 120, None), now=NOW)]
    sealed += [seal(W1, m.CheckpointCommit(JOB, 1, 0, 1, 4 * i, i, bytes([i]) * 32, bytes(32), 1.0, None), now=NOW + 1 + i)
               for i in range(20)]
    sealed += [seal(W1, report(0, 1), now=NOW + 30),
               seal(COORD, m.Verdict(JOB, 1, 0, 1, W1.peer_id, 1, True, "ok", (0,)), now=NOW + 31)]
    for i, data in enumerate(sealed):
        store.record(data, NOW + i)
    assert history_for(store, JOB) == sealed  # under the limits: everything, in stored order
    limited = history_for(store, JOB, max_count=8)
    assert limited == [sealed[0], *sealed[1:6], sealed[-2], sealed[-1]]  # decisions and report kept, in order
    size = sum(len(d) for d in (sealed[0], sealed[-2], sealed[-1]))
    assert history_for(store, JOB, max_bytes=size) == [sealed[0], sealed[-2], sealed[-1]]
    store.close()


def test_hashing_a_large_adapter_leaves_the_event_loop_running():
    import torch

    from agent.roles.coordinator import tensors_hash_off_loop
    from agent.train.model import tensors_hash

    tensors = {f"layer{i}.lora_B.weight": torch.full((1024, 1024), float(i)) for i in range(24)}  # 96 MiB
    expected = tensors_hash(tensors)
    ticks_during: list[int] = []

    async def main() -> bytes:
        ticks = 0
        hashing = True

        async def ticker() -> None:
            nonlocal ticks
            while hashing:
                await trio.sleep(0)
                ticks += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0)  # the ticker is running before the hash starts
            before = ticks
            digest = await tensors_hash_off_loop(tensors, trio.CapacityLimiter(1))
            ticks_during.append(ticks - before)
            hashing = False
        return digest

    assert trio.run(main) == expected
    # on the event loop the ticker could not have run at all while the hash ran; in a thread it ran on
    assert ticks_during[0] > 10, ticks_during


def test_store_writes_of_the_job_reader_run_in_a_worker_thread(tmp_path):
    import threading

    agent, view = observer_agent(tmp_path)
    threads: list[int] = []
    record = agent.store.record

    def spy(data, now):
        threads.append(threading.get_ident())
        return record(data, now)

    agent.store.record = spy
    lease = received(COORD, m.ShardLease(JOB, 1, 0, 1, W1.peer_id, 1, NOW + 120, None), NOW + 1)

    async def main() -> int:
        await agent.on_job_message(view, lease)
        return threading.get_ident()

    loop_thread = trio.run(main)
    assert threads and all(t != loop_thread for t in threads)
    assert len(agent.store.envelopes(JOB)) == 1
    agent.store.close()


def test_a_lease_holder_cannot_flood_checkpoint_commits_past_what_its_terms_need(tmp_path):
    """Issue #15 item 5: each checkpoint commit applied, extended the lease and was stored, so a lease
    holder could keep its lease forever and make every follower store tens of thousands of rows. An
    attempt takes at most ``max_checkpoints`` (IPIP-0004 §5.2); the rest are refused, counted, not
    held, not stored, and extend nothing. A new attempt starts with a fresh allowance."""
    from protocol.proof import max_checkpoints

    agent, view = observer_agent(tmp_path)
    clock = [NOW + 1]
    agent.clock = lambda: clock[0]
    cap = max_checkpoints(TERMS)
    assert view.state.config.max_checkpoints == cap and 2 < cap < 10  # 13 steps, every 10, + margin

    def commit(worker: Identity, attempt: int, index: int) -> Received:
        return received(worker, m.CheckpointCommit(JOB, 1, 0, attempt, 10 * index, index, bytes([index]) * 32,
                                                   bytes(32), 1.5, None), clock[0])

    flood = 40

    async def main() -> None:
        await agent.on_job_message(view, received(COORD, m.ShardLease(JOB, 1, 0, 1, W1.peer_id, 1, NOW + 120, None),
                                                  clock[0]))
        for index in range(1, cap + flood + 1):
            clock[0] += 1  # all within the lease (120 s): refused for the cap, not for an expiry
            await agent.on_job_message(view, commit(W1, 1, index))
            if index == cap:
                extended = view.shard(0).expires_at
        assert (view.shard(0).phase, view.shard(0).worker) == (st.ShardPhase.LEASED, W1.peer_id)
        assert view.shard(0).expires_at == extended, "commits past the cap do not extend the lease"
        assert view.refused["checkpoint-cap"] == flood and not view.pending
        # the attempt ends (its holder releases it); the next attempt may commit again
        clock[0] += 1
        await agent.on_job_message(view, received(W1, m.ShardRelease(JOB, 1, 0, 1, "bye"), clock[0]))
        await agent.on_job_message(view, received(COORD, m.ShardLease(JOB, 1, 0, 2, W2.peer_id, 1, NOW + 900, None),
                                                  clock[0]))
        await agent.on_job_message(view, commit(W2, 2, 1))
        assert view.shard(0).checkpoints == 1

    trio.run(main)
    stored = agent.store.envelopes(JOB, stored_order=True)
    kinds = [type(s.message).__name__ for s in stored]
    assert kinds.count("CheckpointCommit") == cap + 1, kinds
    assert len(view.commits[(1, 0, 1)]) == cap
    agent.store.close()


@pytest.mark.network
async def test_a_coordinators_decisions_are_stored_before_they_are_published(tmp_path, tiny_model_dir):
    """Issue 23: a coordinator's own leases, verdicts and aggregates are evidence when it makes them
    (agent/node.py commit: store, publish, act), not when their gossip echo comes back, so a crash right
    after a publish loses nothing the others may act on. Every agent's publishes are watched (the real
    publish still runs): each decision's envelope must already be in its signer's store."""
    from tests.roles.conftest import fast_spec, network, write_dataset

    dataset = write_dataset(tmp_path / "demo.jsonl")
    published: list[tuple[str, bool]] = []
    async with network(tmp_path, tiny_model_dir, workers=3) as net:
        for agent in [net.submitter, *net.workers]:
            real = agent.net.gossip.publish_sealed

            async def watched(message, data, agent=agent, real=real):
                if isinstance(message, (m.ShardLease, m.Verdict, m.AggregatePublished)):
                    mid = open_envelope(data, now=agent.clock()).envelope.message_id
                    published.append((type(message).__name__, agent.store.has_envelope(mid)))
                return await real(message, data)

            agent.net.gossip.publish_sealed = watched
        terms = await net.submitter.submitter.prepare_terms(fast_spec(shards=2, rounds=1), dataset,
                                                            str(tiny_model_dir))
        view = await net.submitter.submitter.announce(terms)
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=180)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
    kinds = {kind for kind, _ in published}
    assert kinds == {"ShardLease", "Verdict", "AggregatePublished"}, published
    assert all(stored for _, stored in published), [p for p in published if not p[1]]
