"""Issue 24: a round's start carried as an update (IPIP-0006 §2.8.1, ``training.aggregate_codec``).

A real network (a submitter and three agents on loopback, real training of the tiny model): with the job's
aggregates coded, rounds 2 and 3 publish an update beside their aggregate, round 1's and the last travel whole,
every start of rounds 3 and 4 is rebuilt by its worker from the update onto the start it trained its last round
from (no whole fetch), the submitter keeps those aggregates the same way, and every proof's step 0 is the
published aggregate (the replays accept every report). Its first round is shorter than the others
(``training.first_round_steps``), as a long-round job's is (IPIP-0006 §2.5).
"""

from __future__ import annotations

import pytest

from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_workers_rebuild_coded_aggregates_from_their_updates_and_the_job_ends_done(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    async with network(tmp_path, tiny_model_dir, workers=3) as net:
        submitter, workers = net.submitter, net.workers
        spec = fast_spec(shards=2, rounds=4, training=", report_codec: int4-fresh, aggregate_codec: int4-fresh, "
                                                      "first_round_steps: [4]")
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        assert terms.training.aggregate_codec == "int4-fresh"
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=240)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert not [v for v in view.verdicts.values() if not v.accepted]
        assert all(key[2] == 1 for key in view.reports), sorted(view.reports)
        # round 1 trained the job's first_round_steps (4), the others max_steps (8), and each replayed as trained
        assert {(r, report.steps) for (r, _, _), (report, _) in view.reports.items()} == {(1, 4), (2, 8), (3, 8), (4, 8)}
        # rounds 2 and 3 are coded; round 1's start is no bundle, round 4's aggregate is the job's result
        assert [view.aggregates[r].update_cid is not None for r in (1, 2, 3, 4)] == [False, True, True, False]
        counters = [dict(w.counters) for w in workers]
        rebuilt = sum(c.get("starts_rebuilt", 0) for c in counters)
        assert sum(c.get("starts_not_rebuilt", 0) for c in counters) == 0, counters
        # an early start's aggregate is computed by its worker from the round's reports (agent/combine.py), each one
        # the announced CID; the other starts of rounds 3 and 4 are rebuilt from their updates: no whole fetch
        combined = sum(c.get("starts_combined_here", 0) for c in counters)
        assert sum(c.get("starts_not_combined_here", 0) for c in counters) == 0, counters
        assert combined >= 1 and rebuilt + combined >= 4, counters
        # ... computed as soon as the round's last report was in, before the coordinator announced it (combine_ahead)
        assert sum(c.get("starts_combined_ahead", 0) for c in counters) >= 1, counters
        kept = dict(submitter.counters)
        assert kept.get("aggregates_not_rebuilt", 0) == 0 and kept.get("aggregates_rebuilt", 0) >= 1, kept
        # the submitter holds every aggregate, rebuilt or fetched, as the bytes its CID names

        for r in (1, 2, 3, 4):
            cid = view.aggregates[r].adapter_cid
            assert await submitter.content.read_local(cid, tmp_path / f"check-r{r}.tar"), r
