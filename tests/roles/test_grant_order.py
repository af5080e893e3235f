"""The coordinator's order of grants on real agents (IPIP-0004 §12 "Order of grants",
agent/roles/coordinator.py ``_grant_claims``/``_shards_scarce``): when open shards are scarce, the
claims of one ``claim_window`` are granted best reputation first, whatever their arrival order; when
they are not, a claim is granted at once, without waiting for the window.

w0 is the only peer that coordinates. The workers ask more per hour than the jobs below pay, so none
claims by itself: the claims are the ones the test has w1 and w2 sign and gossip, in a known order.
w2's reputation is earned first, on a real job that pays enough for it alone."""

from __future__ import annotations

import pytest
import trio

from protocol import messages as m
from protocol import state as st
from protocol.market import Reputation
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def _announce(net, spec, dataset, model_dir):
    submitter = net.submitter
    terms = await submitter.submitter.prepare_terms(spec, dataset, str(model_dir))
    return await submitter.submitter.announce(terms)


async def _coordinated(net, job_id: bytes):
    """The job as w0 coordinates it, once w0 coordinates it and w1 and w2 follow it."""
    w0, w1, w2 = net.workers
    await w0.wait_for(lambda: job_id in w0.jobs and w0.is_coordinator(w0.jobs[job_id]), timeout=30)
    for w in (w1, w2):
        await w.wait_for(lambda w=w: job_id in w.jobs, timeout=30)
    return w0.jobs[job_id]


async def test_scarce_shards_go_to_the_better_reputed_claimant_and_plenty_are_granted_at_once(
        tmp_path, tiny_model_dir):
    overrides = {0: {"price_per_hour": 5.0}, 1: {"price_per_hour": 5.0, "can_coordinate": False},
                 2: {"price_per_hour": 1.0, "can_coordinate": False}}
    dataset = write_dataset(tmp_path / "demo.jsonl", n=80)
    async with network(tmp_path, tiny_model_dir, workers=3, overrides=overrides) as net:
        w0, w1, w2 = net.workers

        # w2 earns a reputation: a job paying 2/h, which only w2 (asking 1/h) claims; w0 accepts its work.
        # Two volunteer jobs nobody claims by itself are announced with it (their elections run meanwhile)
        earned = await _announce(net, fast_spec(shards=1, rounds=1, extra="budget: {price_per_hour: 2.0, total: 10}\n"),
                                 dataset, tiny_model_dir)
        scarce_job = await _announce(net, fast_spec(shards=1, rounds=1), dataset, tiny_model_dir)
        plenty_job = await _announce(net, fast_spec(shards=2, rounds=1), dataset, tiny_model_dir)
        await net.submitter.wait_for(lambda: earned.state.terminal, timeout=120)
        assert earned.state.phase is st.JobPhase.DONE, earned.state.reason
        assert {lease.worker for lease in earned.leases.values()} == {w2.peer_id}
        w0.reputations._at = -1e18  # recounted now, not at the end of its 5 s cache
        reputations = w0.reputations.get()
        assert reputations[w2.peer_id].accepted == 1
        assert reputations[w2.peer_id].score > reputations.get(w1.peer_id, Reputation()).score == 0.5

        # scarce: one open shard, two peers that could claim it. w1 claims first, w2 a moment later,
        # both within the window: the lease goes to w2, the better reputed, after the window
        scarce = await _coordinated(net, scarce_job.job_id)
        assert not scarce.leases
        w0.coordinator.claim_window = 1.5
        assert w0.coordinator._shards_scarce(scarce)
        started = w0.clock()
        await w1.publish(m.ShardClaim(scarce.job_id, 1, 0))
        await trio.sleep(0.3)
        await w2.publish(m.ShardClaim(scarce.job_id, 1, 0))
        await w0.wait_for(lambda: bool(scarce.leases), timeout=20)
        assert [lease.worker for lease in scarce.leases.values()] == [w2.peer_id]
        assert w0.clock() - started >= 1.0  # the claims waited for the window
        await trio.sleep(0.5)
        assert [lease.worker for lease in scarce.leases.values()] == [w2.peer_id]  # w1's claim found no shard
        assert not scarce.training_by(w1.peer_id)

        # not scarce: two open shards for the two peers that could claim one. A claim is granted at
        # once, long before a window that would otherwise hold it back
        plenty = await _coordinated(net, plenty_job.job_id)
        assert not plenty.leases
        w0.coordinator.claim_window = 60.0
        assert not w0.coordinator._shards_scarce(plenty)
        started = w0.clock()
        await w1.publish(m.ShardClaim(plenty.job_id, 1, 1))
        await w0.wait_for(lambda: bool(plenty.leases), timeout=20)
        assert w0.clock() - started < 10  # not held for the 60 s window
        ((key, lease),) = plenty.leases.items()
        assert lease.worker == w1.peer_id and key == (1, 1, lease.attempt)


def test_workers_fetch_a_round_start_from_its_holders_in_orders_of_their_own():
    """The coordinator and the submitter both hold a round's aggregate before it is announced: each worker asks
    them in its own order (half of them the submitter first), a holder whose heartbeats stopped last."""
    from agent.roles.worker import spread

    holders = ["coordinator", "submitter"]
    firsts = [spread(holders, f"worker-{i}", {"coordinator", "submitter"})[0] for i in range(64)]
    assert 16 <= firsts.count("submitter") <= 48, firsts.count("submitter")
    assert all(sorted(spread(holders, f"worker-{i}", set(holders))) == holders for i in range(8))
    assert spread(holders, "worker-1", set(holders)) == spread(holders, "worker-1", set(holders))  # stable
    assert all(spread(holders, f"worker-{i}", {"coordinator"})[0] == "coordinator" for i in range(64))
    assert spread(["coordinator", "coordinator"], "w", set()) == ["coordinator"]
