"""Issue 24 §2: a round's costs hidden behind the next round's training (IPIP-0006 §2.9, early start).

The coordinator computes a round's aggregate as soon as every report of it has checked out, before the
replays end, and announces it (``early``) with the shard of the next round each of the round's workers
will be leased. A named worker trains that shard at once, from that start, and announces nothing of it
(no checkpoint, no report) until the lease is its own and the aggregate published is the one announced.
The job's result is bit for bit the one it has without early start: the same reports, the same aggregates.
"""

from __future__ import annotations

import pytest

from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def _run(tmp_path, tiny_model_dir, early: bool, rounds: int = 3):
    tmp_path.mkdir(parents=True)
    dataset = write_dataset(tmp_path / "demo.jsonl")
    overrides = {i: {"early_start": early} for i in range(3)}
    async with network(tmp_path, tiny_model_dir, workers=3, overrides=overrides, common={"early_start": early}) as net:
        submitter, workers = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(fast_spec(shards=2, rounds=rounds), dataset, str(tiny_model_dir))
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=180)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        counters = {w.peer_id: dict(w.counters) for w in workers}
        coordinator = counters.get(view.coordination.coordinator, {})
        rejected = [v for v in view.verdicts.values() if not v.accepted]
        return view, counters, coordinator, rejected


async def test_workers_train_the_next_round_before_its_aggregate_and_the_job_ends_the_same(tmp_path, tiny_model_dir):
    view, counters, coordinator, rejected = await _run(tmp_path / "early", tiny_model_dir, early=True)
    assert not rejected
    # rounds 2 and 3 were announced early and their aggregates not computed again
    assert coordinator.get("early_starts_announced", 0) == 2, coordinator
    assert coordinator.get("aggregates_computed_early", 0) == 2, coordinator
    started = sum(c.get("early_starts", 0) for c in counters.values())
    leased = sum(c.get("early_starts_leased", 0) for c in counters.values())
    assert started >= 2 and leased == started, counters  # every early start became its announced lease
    assert sum(c.get("early_starts_dropped", 0) for c in counters.values()) == 0
    # no lease of the job went unused: one attempt per shard and round
    assert all(key[2] == 1 for key in view.reports), sorted(view.reports)
    plain, _, _, _ = await _run(tmp_path / "plain", tiny_model_dir, early=False)
    assert [view.aggregates[r].adapter_cid for r in (1, 2, 3)] == [plain.aggregates[r].adapter_cid for r in (1, 2, 3)]
