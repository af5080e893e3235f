"""Issue 15 (13): a job owns its tasks (agent/tasks.py ``own_job``): ending it ends them.

A lone submitter announces a job (its re-announcer and a stuck task run in the job's nursery) and
cancels it: the re-announcer, which waits on the job's events rather than sleeping its 60 s, is gone
at once; the stuck task is cancelled after the grace; the job's nursery is then closed, so a task
started for the ended job is refused. Real agent, real gossip, real store."""

from __future__ import annotations

import pytest
import trio

from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_ending_a_job_ends_its_tasks(tmp_path, tiny_model_dir):
    async with network(tmp_path, tiny_model_dir, workers=0) as net:
        agent = net.submitter
        agent.tasks.end_grace = 1.0
        assert agent.submitter.reannounce_seconds >= 60  # the re-announcer would sleep that long
        terms = await agent.submitter.prepare_terms(fast_spec(shards=1, rounds=1),
                                                    write_dataset(tmp_path / "d.jsonl"), str(tiny_model_dir))
        view = await agent.submitter.announce(terms)
        job_nursery = agent.job_tasks[view.job_id]
        stuck_cancelled = trio.Event()

        async def stuck() -> None:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                stuck_cancelled.set()
                raise

        assert agent.spawn_in_job(view.job_id, stuck)
        await trio.sleep(0.1)
        assert len(job_nursery.child_tasks) >= 2  # the re-announcer (and the budget watch, if paid) + stuck

        start = trio.current_time()
        await agent.submitter.cancel(view, "test: end the job")
        assert view.state.phase is st.JobPhase.CANCELLED
        with trio.fail_after(0.5):  # the re-announcer woke on the job's end: no 60 s sleep to finish
            while len(job_nursery.child_tasks) > 1:
                await agent.wait_until(lambda: len(job_nursery.child_tasks) <= 1, 0.5)
        assert not stuck_cancelled.is_set()  # the grace: what ended the job may still be finishing
        with trio.fail_after(5):
            await stuck_cancelled.wait()
        assert trio.current_time() - start >= agent.tasks.end_grace - 0.01
        with trio.fail_after(2):
            while view.job_id in agent.job_tasks:
                await trio.sleep(0.05)
        assert len(job_nursery.child_tasks) == 0
        assert not agent.spawn_in_job(view.job_id, trio.sleep_forever)  # the job ended: nothing starts
