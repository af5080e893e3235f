"""A worker whose lease ran out while it could not train stops that attempt and takes the new lease
(agent/roles/worker.py drop_stale; issue 25: after a full disk a worker trained its expired attempt to
the end, its report refused, while the new lease it was given ran out unused and the job FAILED)."""

from __future__ import annotations

import pytest
import trio

from agent.harness.byzantine import STALL_SECONDS
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


@pytest.mark.slow  # passes alone (74 s); timed out twice in the clean-clone CI run beside other tests, the
# worker never logging the drop: not understood yet (issue 25 stays open on it)
async def test_a_worker_drops_its_expired_attempt_and_trains_the_new_one(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    # w0 coordinates and trains nothing; w1, the only trainer, stalls STALL_SECONDS on its first shard
    spec = fast_spec(shards=1, rounds=1, max_retries=2, lease_seconds=30, max_steps=4)
    async with network(tmp_path, tiny_model_dir, workers=2, misbehave={1: "stall_once"},
                       overrides={0: {"accept_training": False}}) as net:
        submitter, (w0, w1) = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        started = trio.current_time()
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=STALL_SECONDS + 90)
        took = trio.current_time() - started
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        [(key, verdict)] = [(k, v) for k, v in view.verdicts.items() if v.accepted]
        assert key == (1, 0, 2) and verdict.worker == w1.peer_id  # attempt 2, by the same worker
        # it did not wait out the stall and train attempt 1 to the end first (before: a report refused)
        assert (1, 0, 1) not in view.reports
        assert took < STALL_SECONDS, took
