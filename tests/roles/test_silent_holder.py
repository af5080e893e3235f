"""A lease whose holder the coordinator no longer hears is revoked (IPIP-0004 §5.3), and a holder that was alive
after all stops that attempt when it hears the revoke, then trains the shard again under a new lease.

The worker-crash scenario and worker-kill9-gone (slow; separate processes) cover a holder that died."""

from __future__ import annotations

import pytest
import trio

from agent.harness.byzantine import STALL_SECONDS
from agent.train.runner import run_torch
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_a_silent_holder_loses_its_lease_long_before_it_runs_out_and_stops_that_attempt(tmp_path,
                                                                                             tiny_model_dir):
    dataset = write_dataset(tmp_path / "demo.jsonl")
    await trio.to_thread.run_sync(run_torch, lambda: None)  # the first import of peft/transformers, not in the lease
    # an hour's lease (the default): without the revoke the job waits it out
    spec = fast_spec(shards=1, rounds=1, max_retries=0, lease_seconds=3600, max_steps=4)
    # w0 coordinates and trains nothing; w1, the only trainer, sends no heartbeat through its first shard and
    # stalls STALL_SECONDS on it (a worker cut off from its peers while it works). w1 may not coordinate.
    async with network(tmp_path, tiny_model_dir, workers=2, misbehave={1: "mute_once"},
                       overrides={0: {"accept_training": False}, 1: {"can_coordinate": False}}) as net:
        submitter, (w0, w1) = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        started = trio.current_time()
        view = await submitter.submitter.announce(terms)
        try:
            await submitter.wait_for(lambda: view.state.terminal, timeout=STALL_SECONDS - 10)
        except trio.TooSlowError:
            pytest.fail(f"the job did not end in {STALL_SECONDS - 10:.0f} s: {view.state.phase.value}, "
                        f"{view.state.shards[0]}, revocations {sorted(view.revocations)}, "
                        f"w1's stall cut short: {w1.worker.training.stall_cut_short}")
        took = trio.current_time() - started
        assert view.coordination.coordinator == w0.peer_id
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        # attempt 1 revoked by the coordinator, excused (max_retries 0 left the shard its second attempt)
        [(key, revoke)] = view.revocations.items()
        assert key == (1, 0, 1) and revoke.worker == w1.peer_id and revoke.silent_seconds >= 15.0
        assert w0.counters["leases_revoked"] == 1 and w1.counters["our_leases_revoked"] == 1
        [(key, verdict)] = [(k, v) for k, v in view.verdicts.items() if v.accepted]
        assert key == (1, 0, 2) and verdict.worker == w1.peer_id  # attempt 2, by the same worker, heard again
        # w1 stopped attempt 1 when it heard the revoke (drop_stale cancelled the stall): no report of it
        assert w1.worker.training.stall_cut_short and (1, 0, 1) not in view.reports
        assert took < STALL_SECONDS, took
