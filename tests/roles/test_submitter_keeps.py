"""Issue 15: the submitter keeps every accepted adapter and aggregate, trying again until it holds
them, and ``job show`` lists what it does not hold yet. Issue 21 (2): a round's aggregate, and a
verdict accepting an adapter, are not published until the submitter holds the bytes, so nothing
announced can die with its coordinator. The fault is real: a file stands where the submitter's copies
go, so every copy fails until it is removed; the coordinator meanwhile keeps asking and publishes
nothing."""

from __future__ import annotations

import pytest
import trio

from agent.control import job_detail
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_submitter_retries_keeping_accepted_work_and_job_show_lists_what_it_lacks(tmp_path, tiny_model_dir):
    async with network(tmp_path, tiny_model_dir, workers=3) as net:
        submitter = net.submitter
        submitter.submitter.keep_retry_delays = (1.0,) * 30
        spec = fast_spec(shards=2, rounds=1)
        terms = await submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"), str(tiny_model_dir))
        blocker = submitter.work_dir / terms.job_id().hex()[:16] / "accepted"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("in the way")  # no copy can be written while this file stands there
        for worker in net.workers:
            worker.coordinator.retry_delays = (1.0,) * 60
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: len(view.reports) >= 2, timeout=90)
        with trio.fail_after(30):  # the coordinator asks the submitter to keep each accepted adapter, again and again
            while sum(w.counters["keeps_retried"] for w in net.workers) < 2:
                await trio.sleep(0.2)
        # nothing is accepted while the submitter cannot hold it: no verdict, no aggregate
        assert not view.verdicts and not view.aggregates, view.verdicts
        assert job_detail(submitter, view)["not_held"] == []

        blocker.unlink()  # room again: the adapters land, the verdicts and the aggregate follow
        await submitter.wait_for(lambda: view.state.terminal, timeout=60)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        accepted = {r.adapter_cid for k, (r, _) in view.reports.items() if k in view.verdicts and view.verdicts[k].accepted}
        assert len(accepted) == 2
        with trio.fail_after(20):
            while job_detail(submitter, view)["not_held"]:
                await trio.sleep(0.2)
        for cid in accepted | {view.aggregates[1].adapter_cid}:
            assert submitter.submitter.kept_path(view, cid).stat().st_size > 0
