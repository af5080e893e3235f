"""Two views that name each other's peer as a job's coordinator: both peers live, neither acts (IPIP-0006 §1.3
rule 10). The soak (seed 17, separate agent processes) reached it: a coordinator in term 3 rebuilt its mirror from
the restarted submitter's older history, which took its view back to term 1 and that term's coordinator, a live
peer; everyone else, that peer included, had followed it into term 3. Nobody leased, and the job stood in round 2
until its deadline. Here the coordinator's view is set at the start to name the runner-up, as that rebuild left it;
the others must depose the coordinator that never claims its term, and the job must end DONE."""

from __future__ import annotations

import pytest
import trio

from protocol import state as st
from protocol.election import UNCLAIMED_FACTOR, Coordination, rank_peers
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_a_live_coordinator_that_never_claims_its_term_is_deposed(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = fast_spec(shards=2, rounds=1, max_steps=4, lease_seconds=60)
    async with network(tmp_path, tiny_model_dir, workers=3) as net:
        submitter, workers = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        job_id = terms.job_id()
        first, second = rank_peers(job_id, [w.peer_id for w in workers])[:2]
        coordinator = next(w for w in workers if w.peer_id == first)
        view = await submitter.submitter.announce(terms)
        # before the coordinator forms its first view (the grace period): its view names the runner-up, a live
        # peer, in term 1, as the rebuild left it in the soak; the runner-up's view names the coordinator
        with trio.fail_after(10):
            while job_id not in coordinator.jobs:
                await trio.sleep(0.01)
        own = coordinator.jobs[job_id]
        assert own.coordination.term == 0, "the coordinator formed its view before the test could set it"
        own.coordination = Coordination(job_id, 1, second)
        window = UNCLAIMED_FACTOR * submitter.peer_table.silence
        # rule 10's clock in the coordinator's own view, started a window ago less 3 s (in the soak the rebuilt view
        # stood so for minutes): the deposition itself runs as it would, 3 s after the grace instead of a whole
        # window (40 s) later
        coordinator.jobclock.named[job_id] = ((1, second), coordinator.jobclock.clock() - window + 3)
        with trio.fail_after(window + 90):
            await submitter.wait_for(lambda: view.state.terminal, timeout=window + 90)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        # the job went on only once a view deposed the coordinator that did not claim its term: the others
        # deposed the coordinator (term 2 goes to the runner-up), or the coordinator deposed the runner-up its
        # view named (term 2 goes to itself, and the others adopt that term from its first lease); either way
        # nothing was leased in term 1, and the two views agree again
        assert view.coordination.term >= 2
        assert (own.coordination.term, own.coordination.coordinator) == \
            (view.coordination.term, view.coordination.coordinator)
        assert min(lease.term for lease in view.leases.values()) >= 2
