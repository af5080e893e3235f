"""Issue 15: the submitter keeps every accepted adapter and aggregate, trying again until it holds
them, and ``job show`` lists what it does not hold yet. Issue 21 (2): a round's aggregate is not
published until the submitter holds it, so nothing announced can die with its coordinator. The fault
is real: a file stands where the submitter's copies go, so every copy fails until it is removed; the
coordinator meanwhile keeps asking and publishes nothing."""

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
        await submitter.wait_for(lambda: view.state.phase is st.JobPhase.AGGREGATING, timeout=90)

        accepted = {r.adapter_cid for k, (r, _) in view.reports.items() if k in view.verdicts and view.verdicts[k].accepted}
        assert len(accepted) == 2
        missing = job_detail(submitter, view)["not_held"]
        assert {i["cid"] for i in missing} == accepted, missing
        assert {i["kind"] for i in missing} == {"adapter"}
        await trio.sleep(3)  # the coordinator asks again every second: nothing is published meanwhile
        assert not view.aggregates and view.state.phase is st.JobPhase.AGGREGATING
        assert sum(w.counters["keeps_retried"] for w in net.workers) >= 2

        blocker.unlink()  # room again: the copies the submitter keeps trying now land, the aggregate too
        await submitter.wait_for(lambda: view.state.terminal, timeout=60)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        with trio.fail_after(20):
            while job_detail(submitter, view)["not_held"]:
                await trio.sleep(0.2)
        for cid in accepted | {view.aggregates[1].adapter_cid}:
            assert submitter.submitter.kept_path(view, cid).stat().st_size > 0
