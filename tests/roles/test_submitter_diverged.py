"""A submitter whose own mirror diverged on something it stored, not on something it missed, rebuilds it
from its coordinator's history (agent/roles/sync.JobSync._rebuild_from, IPIP-0004 §11.1).

Met with agent processes (scenario submitter-coordinator-down, three copies at once on 2 cores): the
restarted submitter heard a lease by catching up, its clock for that lease ran out 0.1 s before the
holder's first checkpoint reached it, while the other mirrors, which had heard the lease later, took the
checkpoint. The submitter's mirror reopened the shard and held the report, the verdict and every aggregate
after it: the others ended the job DONE, the submitter said TRAINING until the scenario's 150 s ran out,
"caught up on nothing ... 21 held" every 15 s (its store held every message: nothing to catch up on). Here
the submitter's lease clock is run out by hand, the way that late checkpoint did it."""

from __future__ import annotations

import pytest

from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_a_submitter_whose_lease_clock_ran_out_alone_rebuilds_from_the_coordinator_and_ends_done(
        tmp_path, tiny_model_dir):
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        spec = fast_spec(shards=1, rounds=1, lease_seconds=30)
        terms = await submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"), str(tiny_model_dir))
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.shard(0).phase is st.ShardPhase.LEASED, timeout=90)
        # our clock for the lease runs out before the holder's checkpoint reaches us; nobody else's does
        view.tick(submitter.clock() + spec.lease_seconds + 1)
        assert view.shard(0).phase is st.ShardPhase.OPEN and view.shard(0).attempt == 1

        others = [w.jobs[view.job_id] for w in net.workers]
        for worker, mirror in zip(net.workers, others):
            await worker.wait_for(lambda m=mirror: m.state.terminal, timeout=90)
        assert all(m.state.phase is st.JobPhase.DONE for m in others)
        await submitter.wait_for(lambda: view.state.terminal, timeout=60)
        assert view.state.phase is st.JobPhase.DONE, (view.state, len(view.pending))
        final = others[0].aggregates[1].adapter_cid
        assert view.aggregates[1].adapter_cid == final
        # the attempt the others accepted is the one our mirror holds accepted now, not a reopened shard
        assert view.verdicts and all(v.accepted and v.attempt == 1 for v in view.verdicts.values())
