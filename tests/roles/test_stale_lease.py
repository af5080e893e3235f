"""A worker whose lease ran out while it could not train stops that attempt and takes the new lease
(agent/roles/worker.py drop_stale; issue 25: after a full disk a worker trained its expired attempt to
the end, its report refused, while the new lease it was given ran out unused and the job FAILED)."""

from __future__ import annotations

import pytest
import trio

from agent.harness.byzantine import STALL_SECONDS
from agent.train.runner import run_torch
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network

# attempt 1's lease runs out while w1 stalls: the wait the test is about. Attempt 2 must report within
# one lease (with the imports done first, 3-5 s on a loaded 2-core machine) and be verified within one
# more (5-12 s there)
LEASE_SECONDS = 25


async def test_a_worker_drops_its_expired_attempt_and_trains_the_new_one(tmp_path, tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    # the first import of peft and transformers in this process takes 15 s or more on a loaded machine: done
    # here, not in the worker's first real attempt, whose lease it would eat
    await trio.to_thread.run_sync(run_torch, lambda: None)
    spec = fast_spec(shards=1, rounds=1, max_retries=2, lease_seconds=LEASE_SECONDS, max_steps=4)
    # w0 coordinates and trains nothing; w1, the only trainer, stalls STALL_SECONDS on its first shard.
    # w1 must not coordinate: a stall_once worker may (byzantine.FAULTY), and when the election (by the
    # job ID, which changes with the terms' 'created' second) picked it, nobody trained (a coordinator
    # trains nothing of its job) and the job sat ANNOUNCED until the test timed out: the CI failures.
    async with network(tmp_path, tiny_model_dir, workers=2, misbehave={1: "stall_once"},
                       overrides={0: {"accept_training": False}, 1: {"can_coordinate": False}}) as net:
        submitter, (w0, w1) = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        started = trio.current_time()
        view = await submitter.submitter.announce(terms)
        try:  # a worker that waits out its stall takes longer than STALL_SECONDS
            await submitter.wait_for(lambda: view.state.terminal, timeout=STALL_SECONDS - 10)
        except trio.TooSlowError:
            pytest.fail(f"the job did not end in {STALL_SECONDS - 10:.0f} s: {view.state.phase.value}, "
                        f"{view.state.shards[0]}, coordinator {net.name_of(view.coordination.coordinator)}, "
                        f"w1's stall cut short: {w1.worker.training.stall_cut_short}")
        took = trio.current_time() - started
        assert view.coordination.coordinator == w0.peer_id
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        [(key, verdict)] = [(k, v) for k, v in view.verdicts.items() if v.accepted]
        assert key == (1, 0, 2) and verdict.worker == w1.peer_id  # attempt 2, by the same worker
        # w1 stopped attempt 1 once its lease ran out (drop_stale cancelled the stall) rather than waiting
        # out the stall and training attempt 1 to the end first (before: a report refused)
        assert w1.worker.training.stall_cut_short
        assert (1, 0, 1) not in view.reports
        assert took < STALL_SECONDS, took
