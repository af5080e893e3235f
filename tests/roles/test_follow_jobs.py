"""Issue 15 (5): the jobs an agent follows are bounded without locking it out of new ones.

Followed jobs were never dropped and ``MAX_JOBS_FOLLOWED`` was a hard cap: 256 announcements (one
Sybil identity's, or a long uptime's real jobs) stopped an agent following any new job until it
restarted, each with its topic reader and subscription forever. Now an ended job is forgotten after
``ended_job_retention`` (or at once when a new job needs its room), its topic left; and one announcer
has at most ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended jobs followed. Real agents on loopback, real
signed announcements fed to the follow logic (``Agent.follow_job``), real store.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio

import agent.node as node
from protocol import messages as m
from protocol import state as st
from protocol.envelope import seal
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_terms
from tests.roles.conftest import network

pytestmark = pytest.mark.network


async def announce_to(agent, identity: Identity, name: str):
    """``identity`` announces a job named ``name``; ``agent`` is handed its signed announcement."""
    terms = dataclasses.replace(sample_terms(identity), name=name, deadline=0)  # no deadline: it lives until ended
    envelope = seal(identity, m.JobAnnouncement.for_terms(terms), now=agent.clock())
    return terms, await agent.follow_job(terms, identity.peer_id, envelope)


async def test_one_announcer_cannot_fill_the_jobs_an_agent_follows(tmp_path, tiny_model_dir):
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        sybil = Identity.generate()
        views = [(await announce_to(w0, sybil, f"sybil-{i}"))[1] for i in range(node.MAX_LIVE_JOBS_PER_SUBMITTER + 4)]
        followed = [v for v in views if v is not None]
        assert len(followed) == node.MAX_LIVE_JOBS_PER_SUBMITTER
        assert w0.counters["jobs_not_followed"] == 4
        # another announcer's job is followed, and so is the Sybil's next one once one of its jobs ended
        assert (await announce_to(w0, Identity.generate(), "honest"))[1] is not None
        first = followed[0]
        w0.apply_actions(first, first.step(st.Cancel("test: ended"), w0.clock()))
        assert (await announce_to(w0, sybil, "sybil-after"))[1] is not None


async def test_ended_jobs_make_room_are_forgotten_after_their_retention_and_leave_their_topics(
        tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(node, "MAX_JOBS_FOLLOWED", 4)
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        gossip = w0.net.gossip
        jobs = [await announce_to(w0, Identity.generate(), f"job-{i}") for i in range(4)]
        assert all(view is not None for _, view in jobs) and len(w0.jobs) == 4
        assert (await announce_to(w0, Identity.generate(), "one too many"))[1] is None  # full of live jobs

        # job 0 ends: the next announcement takes its room at once, and job 0's topic is left
        (terms0, view0) = jobs[0]
        w0.apply_actions(view0, view0.step(st.Cancel("test: ended"), w0.clock()))
        assert (await announce_to(w0, Identity.generate(), "new"))[1] is not None
        assert view0.job_id not in w0.jobs and len(w0.jobs) == 4
        with trio.fail_after(10):
            while m.job_topic(view0.job_id) in gossip.pubsub.topic_ids:
                await trio.sleep(0.05)
        assert m.job_topic(view0.job_id) not in gossip._subscriptions
        # the store keeps it; an announcement of it again is not followed anew
        assert w0.job_view(view0.job_id).state.phase is st.JobPhase.CANCELLED
        envelope = seal(Identity.generate(), m.JobAnnouncement.for_terms(terms0), now=w0.clock())
        assert await w0.follow_job(terms0, terms0.submitter, envelope) is None and view0.job_id not in w0.jobs

        # job 1 ends with nothing new announced: forgotten once its tasks ended and the retention passed
        w0.job_end_grace, w0.ended_job_retention = 0.2, 0.5
        (_, view1) = jobs[1]
        w0.apply_actions(view1, view1.step(st.Cancel("test: ended"), w0.clock()))
        with trio.fail_after(10):
            while view1.job_id in w0.jobs or m.job_topic(view1.job_id) in gossip.pubsub.topic_ids:
                await trio.sleep(0.05)
        assert view1.job_id not in w0.job_tasks
        # the live jobs are still followed, their topics read
        for _, view in jobs[2:]:
            assert w0.jobs[view.job_id] is view and m.job_topic(view.job_id) in gossip.pubsub.topic_ids
