"""A worker whose attempt is no longer its own stops it and takes the new lease (agent/roles/worker.py drop_stale):
- its lease ran out while it could not train (issue 25: after a full disk a worker trained its expired attempt to
  the end, its report refused, while the new lease it was given ran out unused and the job FAILED);
- the coordinator revoked it because it heard the worker no more (IPIP-0004 §5.3: a worker cut off from its peers
  while it works; the worker-crash scenario and worker-kill9-gone, slow, cover a holder that died).
In both, w0 coordinates and trains nothing, and w1, the only trainer, stalls STALL_SECONDS on its first shard."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

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


@asynccontextmanager
async def stalled_trainer(tmp_path, model_dir, mode: str, lease_seconds: int) -> AsyncIterator[tuple]:
    """One shard, w1 in ``mode`` (stall_once or mute_once) its only trainer: yields (view, w0, w1, seconds taken)
    once the job ended, or fails the test if it did not end before w1's stall would."""
    dataset = write_dataset(tmp_path / "demo.jsonl")
    # the first import of peft and transformers in this process takes 15 s or more on a loaded machine: done
    # here, not in the worker's first real attempt, whose lease it would eat
    await trio.to_thread.run_sync(run_torch, lambda: None)
    spec = fast_spec(shards=1, rounds=1, max_retries=2 if mode == "stall_once" else 0, lease_seconds=lease_seconds,
                     max_steps=4)
    # w1 must not coordinate: a stalling worker may (byzantine.FAULTY), and when the election (by the
    # job ID, which changes with the terms' 'created' second) picked it, nobody trained (a coordinator
    # trains nothing of its job) and the job sat ANNOUNCED until the test timed out: the CI failures.
    async with network(tmp_path, model_dir, workers=2, misbehave={1: mode},
                       overrides={0: {"accept_training": False}, 1: {"can_coordinate": False}}) as net:
        submitter, (w0, w1) = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(model_dir))
        started = trio.current_time()
        view = await submitter.submitter.announce(terms)
        try:  # a worker that waits out its stall takes longer than STALL_SECONDS
            await submitter.wait_for(lambda: view.state.terminal, timeout=STALL_SECONDS - 10)
        except trio.TooSlowError:
            pytest.fail(f"the job did not end in {STALL_SECONDS - 10:.0f} s: {view.state.phase.value}, "
                        f"{view.state.shards[0]}, coordinator {net.name_of(view.coordination.coordinator)}, "
                        f"revocations {sorted(view.revocations)}, w1's stall cut short: "
                        f"{w1.worker.training.stall_cut_short}")
        took = trio.current_time() - started
        assert view.coordination.coordinator == w0.peer_id
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        [(key, verdict)] = [(k, v) for k, v in view.verdicts.items() if v.accepted]
        assert key == (1, 0, 2) and verdict.worker == w1.peer_id  # attempt 2, by the same worker
        # w1 stopped attempt 1 (drop_stale cancelled the stall) rather than waiting out the stall and training
        # attempt 1 to the end first (before: a report refused)
        assert w1.worker.training.stall_cut_short
        assert (1, 0, 1) not in view.reports
        assert took < STALL_SECONDS, took
        yield view, w0, w1


async def test_a_worker_drops_its_expired_attempt_and_trains_the_new_one(tmp_path, tiny_model_dir):
    async with stalled_trainer(tmp_path, tiny_model_dir, "stall_once", LEASE_SECONDS) as (view, w0, w1):
        assert not view.revocations  # its heartbeats came: a slow worker is not revoked, its lease ran out


@pytest.mark.slow  # about 30 s; the worker-crash scenario (a holder that died) is the short version CI runs
async def test_a_silent_holder_loses_its_lease_long_before_it_runs_out_and_stops_that_attempt(tmp_path,
                                                                                             tiny_model_dir):
    # an hour's lease (the default): without the revoke the job waits it out. w1 sends no heartbeat through its
    # first shard (mute_once); max_retries 0: the revoked attempt must be excused for the shard to be trained again
    async with stalled_trainer(tmp_path, tiny_model_dir, "mute_once", 3600) as (view, w0, w1):
        [(key, revoke)] = view.revocations.items()
        assert key == (1, 0, 1) and revoke.worker == w1.peer_id and revoke.silent_seconds >= 15.0
        assert w0.counters["leases_revoked"] == 1 and w1.counters["our_leases_revoked"] == 1
        assert view.state.shards[0].excused == 1
