"""A restarted agent resumes where it was: the job state rebuilt from its store, the job completes."""

from __future__ import annotations

import pytest
import trio

from protocol import messages as m
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_restarted_coordinator_rebuilds_the_job_from_its_store_and_the_job_completes(tmp_path, tiny_model_dir):
    async with network(tmp_path, tiny_model_dir, workers=3) as net:
        spec = fast_spec(shards=3, rounds=2, lease_seconds=20)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"), str(tiny_model_dir))
        view = await net.submitter.submitter.announce(terms)
        await net.submitter.wait_for(lambda: len(view.state.published) >= 1, timeout=120)
        coordinator = next(w for w in net.workers if w.peer_id == view.coordination.coordinator)
        before = coordinator.jobs[view.job_id]
        published, term = before.state.published, before.coordination.term
        stored_before = len(coordinator.store.envelopes(view.job_id))
        await net.kill(coordinator)
        await trio.sleep(0.5)
        again = await net.restart(coordinator)
        resumed = again.jobs[view.job_id]  # rebuilt before run() reported started
        assert resumed is not before
        assert resumed.state.published[:len(published)] == published
        assert resumed.coordination.term >= term and resumed.state.round >= 2
        assert len(resumed.reports) >= 3 and len(resumed.verdicts) >= 3
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=150)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        # the restarted agent took part again: it heard the job's later messages and stored them
        assert len(again.store.envelopes(view.job_id)) > stored_before
        assert again.live_peers() >= {w.peer_id for w in net.alive() if w is not again} | {net.submitter.peer_id}


async def test_a_decision_stored_but_not_sent_before_a_crash_is_sent_after_the_restart(tmp_path, tiny_model_dir):
    """A coordinator stores each decision before it publishes it (agent/evidence.py): killed between the two, its
    restarted mirror holds a lease nobody else heard. Its holder never trains it, and the others' mirrors refuse
    every later attempt of that shard until the lost one is heard (in test_resume's 82 s run the shard went through
    attempts 2 and 3 over 40 s). The restarted agent sends its stored decisions of the round again: the lease lost
    in the crash is the one that trains."""
    async with network(tmp_path, tiny_model_dir, workers=3) as net:
        spec = fast_spec(shards=3, rounds=1, lease_seconds=60)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"), str(tiny_model_dir))
        lost: list[tuple] = []
        for worker in net.workers:
            def swallow(real, agent):
                async def publish_sealed(message, data):
                    if isinstance(message, m.ShardLease) and not lost:
                        lost.append((agent, message))
                        await trio.sleep_forever()  # the crash comes before it is sent
                    return await real(message, data)
                return publish_sealed
            worker.net.gossip.publish_sealed = swallow(worker.net.gossip.publish_sealed, worker)
        view = await net.submitter.submitter.announce(terms)
        await net.submitter.wait_for(lambda: bool(lost), timeout=90)
        coordinator, lease = lost[0]
        assert coordinator.store.leases(view.job_id)  # stored, never sent
        await net.kill(coordinator)
        await trio.sleep(0.5)
        await net.restart(coordinator)
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=150)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        accepted = [key for key, verdict in view.verdicts.items() if verdict.accepted and key[1] == lease.shard]
        assert accepted == [(lease.round, lease.shard, lease.attempt)], (lease, sorted(view.verdicts))
