"""Issue 15: the coordinator's own failures are not verdicts, and are retried.

A coordinator that cannot verify a report (its base model is gone for a moment) retries within the
verification window and never rejects or bans the worker for it; an aggregation that fails for a
moment (its work directory cannot be made) is retried within the aggregation window. The faults
are real: the coordinator's copy of the model is moved away, a file blocks the aggregation's path.
"""

from __future__ import annotations

import shutil

import pytest
import trio

from agent.harness.network import MODEL_NAME
from protocol import state as st
from protocol.election import elect
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_coordinator_own_failures_are_retried_not_held_against_workers(tmp_path, tiny_model_dir):
    workers = 3
    copies = [shutil.copytree(tiny_model_dir, tmp_path / f"model-w{i}") for i in range(workers)]
    overrides = {i: {"models": ((MODEL_NAME, str(copies[i])),)} for i in range(workers)}
    model_gone, aggregate_seen = trio.Event(), trio.Event()
    seen: dict = {}

    def observer(name, agent, kind, args):
        if kind != "state" or agent.peer_id != seen.get("coordinator"):
            return
        _, actions = args
        if any(isinstance(a, st.StartVerification) for a in actions) and not model_gone.is_set():
            seen["model"].rename(seen["model"].with_name("away"))  # before its verifier task starts
            model_gone.set()
        if any(isinstance(a, st.Aggregate) for a in actions):
            aggregate_seen.set()

    async with network(tmp_path, tiny_model_dir, workers=workers, overrides=overrides, observer=observer) as net:
        for w in net.workers:
            w.coordinator.retry_delays = (1.0, 1.0, 2.0, 2.0, 2.0)
        spec = fast_spec(shards=2, rounds=1)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"),
                                                            str(tiny_model_dir))
        coordinator_id = elect(terms.job_id(), [w.peer_id for w in net.workers])
        coordinator = next(w for w in net.workers if w.peer_id == coordinator_id)
        seen["coordinator"] = coordinator_id
        seen["model"] = copies[net.workers.index(coordinator)]
        # the aggregation's work directory cannot be made while a file stands in its place
        blocker = coordinator.work_dir / terms.job_id().hex()[:16] / "aggregate-r1"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("in the way")
        view = await net.submitter.submitter.announce(terms)

        with trio.fail_after(60):
            await model_gone.wait()
        await trio.sleep(3)  # the coordinator lacks its model for 3 s: it cannot verify
        seen["model"].with_name("away").rename(seen["model"])
        with trio.fail_after(60):
            await aggregate_seen.wait()
        await trio.sleep(2)  # the aggregation fails for 2 s
        blocker.unlink()

        await net.submitter.wait_for(lambda: view.state.terminal, timeout=60)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert not [v.reason for v in view.verdicts.values() if not v.accepted]
        assert coordinator.counters["verifications_retried"] >= 1
        assert coordinator.counters["aggregations_retried"] >= 1
