"""Issue 15 (5): the jobs an agent follows are bounded without locking it out of new ones.

Followed jobs were never dropped and ``MAX_JOBS_FOLLOWED`` was a hard cap: 256 announcements (one
Sybil identity's, or a long uptime's real jobs) stopped an agent following any new job until it
restarted, each with its topic reader and subscription forever. Now an ended job is forgotten after
``Tasks.retention`` (or at once when a new job needs its room), its topic left; and one announcer
has at most ``MAX_LIVE_JOBS_PER_SUBMITTER`` unended jobs followed. Real agents on loopback, real
signed announcements fed to the follow logic (``Agent.follow_job``), real store.

The review of that change (findings 3, 4, 5, 8): a submitter announced more live jobs than any
follower follows (now refused, IPIP-0004 §13); eviction could forget a job in its end grace,
cancelling the publication of the decision that ended it; a forgotten job was rebuilt on the event
loop at every ``job show`` and the roles kept its per-job state; re-following a job raced the
background leave of its topic.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import trio

import agent.following as following
from agent import cli, control
from agent.harness.network import MODEL_NAME
from agent.roles.submitter import SubmitRefused
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
        views = [(await announce_to(w0, sybil, f"sybil-{i}"))[1] for i in range(following.MAX_LIVE_JOBS_PER_SUBMITTER + 4)]
        followed = [v for v in views if v is not None]
        assert len(followed) == following.MAX_LIVE_JOBS_PER_SUBMITTER
        assert w0.counters["jobs_not_followed"] == 4
        # another announcer's job is followed, and so is the Sybil's next one once one of its jobs ended
        assert (await announce_to(w0, Identity.generate(), "honest"))[1] is not None
        first = followed[0]
        await w0.commit(first, first.cancel("test: ended", w0.clock()))
        assert (await announce_to(w0, sybil, "sybil-after"))[1] is not None


async def test_ended_jobs_make_room_are_forgotten_after_their_retention_and_leave_their_topics(
        tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(following, "MAX_JOBS_FOLLOWED", 4)
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        gossip = w0.net.gossip
        jobs = [await announce_to(w0, Identity.generate(), f"job-{i}") for i in range(4)]
        assert all(view is not None for _, view in jobs) and len(w0.jobs) == 4
        assert (await announce_to(w0, Identity.generate(), "one too many"))[1] is None  # full of live jobs

        # job 0 ends (its tasks done): the next announcement takes its room at once, and job 0's topic is left
        (terms0, view0) = jobs[0]
        await end(w0, view0)
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
        w0.tasks.end_grace, w0.tasks.retention = 0.2, 0.5
        (_, view1) = jobs[1]
        await w0.commit(view1, view1.cancel("test: ended", w0.clock()))
        with trio.fail_after(10):
            while view1.job_id in w0.jobs or m.job_topic(view1.job_id) in gossip.pubsub.topic_ids:
                await trio.sleep(0.05)
        assert view1.job_id not in w0.job_tasks
        # the live jobs are still followed, their topics read
        for _, view in jobs[2:]:
            assert w0.jobs[view.job_id] is view and m.job_topic(view.job_id) in gossip.pubsub.topic_ids


async def wait_for(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


async def end(agent, view) -> None:
    """The job ends (cancelled); returns once its tasks are done (its end grace over)."""
    await agent.commit(view, view.cancel("test: ended", agent.clock()))
    await wait_for(lambda: view.job_id not in agent.job_tasks)


SPEC = f"""
name: one-too-many
base_model: {MODEL_NAME}
seed: 3
input: {{dataset: demo.jsonl, validation_split: 0.1}}
training: {{batch_size: 8, learning_rate: 0.01, max_steps: 8, max_seq_len: 96}}
lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
shards: 2
rounds: 1
proof: {{checkpoint_every: 4, verify_segments: 1, tolerance: 0.0001}}
lease_seconds: 60
"""


async def test_a_submitter_announces_no_more_live_jobs_than_its_followers_follow(tmp_path, tiny_model_dir, capsys):
    """Review finding 3: followers follow at most MAX_LIVE_JOBS_PER_SUBMITTER unended jobs of one
    submitter, but the submitter announced a 9th that nobody would run, with no hint why. Now it is
    refused with one line naming the limit (the CLI's `job announce` exits 1 with it), until one ends."""
    from tests.roles.conftest import write_dataset

    limit = following.MAX_LIVE_JOBS_PER_SUBMITTER
    async with network(tmp_path, tiny_model_dir, workers=1) as net, trio.open_nursery() as served:
        submitter, (w0,) = net.submitter, net.workers

        def terms(name: str):
            return dataclasses.replace(sample_terms(submitter.identity), name=name, deadline=0)

        views = [await submitter.submitter.announce(terms(f"sweep-{i}")) for i in range(limit)]
        await wait_for(lambda: all(v.job_id in w0.jobs for v in views))  # the follower follows every one
        ninth = terms("sweep-ninth")
        with pytest.raises(SubmitRefused) as refused:
            await submitter.submitter.announce(ninth)
        line = str(refused.value)
        assert len(line.splitlines()) == 1 and f"MAX_LIVE_JOBS_PER_SUBMITTER = {limit}" in line
        assert ninth.job_id() not in submitter.jobs and submitter.store.job(ninth.job_id()) is None

        # the CLI: `infernet job announce` says it in one line, exit status 1, nothing sharded or announced
        home = submitter.config.home
        served.start_soon(control.serve_control, submitter, control.bind_control_socket(home / "control.sock"))
        spec = tmp_path / "spec" / "infernet.train.yml"
        spec.parent.mkdir()
        spec.write_text(SPEC)
        write_dataset(spec.parent / "demo.jsonl")
        capsys.readouterr()
        status = await trio.to_thread.run_sync(cli.main, ["job", "announce", str(spec), "--home", str(home), "--yes"])
        err = capsys.readouterr().err
        assert status == 1 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("infernet: ") and f"MAX_LIVE_JOBS_PER_SUBMITTER = {limit}" in err, err
        assert len(submitter.jobs) == limit and not list(submitter.work_dir.glob("submit-*"))

        # once one of them ended, the next is announced, and followed
        await submitter.submitter.cancel(views[0], "test: make room")
        view = await submitter.submitter.announce(ninth)
        assert view.job_id == ninth.job_id()
        await wait_for(lambda: ninth.job_id() in w0.jobs)
        served.cancel_scope.cancel()


async def test_a_job_in_its_end_grace_is_not_forgotten_to_make_room(tmp_path, tiny_model_dir, monkeypatch):
    """Review finding 4: eviction forgot an ended job whose tasks still ran (the coordinator publishing
    the decision that ended it), cancelling them. Such a job keeps its room: the new one is refused,
    as when every followed job is live; once its tasks are done it makes room."""
    monkeypatch.setattr(following, "MAX_JOBS_FOLLOWED", 2)
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        (_, ended), (_, live) = [await announce_to(w0, Identity.generate(), f"job-{i}") for i in range(2)]
        publishing, published = trio.Event(), trio.Event()

        async def publish_the_decision() -> None:  # e.g. the final aggregate's publication after it applied
            publishing.set()
            await trio.sleep(1.0)
            published.set()

        assert w0.spawn_in_job(ended.job_id, publish_the_decision)
        await w0.commit(ended, ended.cancel("test: ended", w0.clock()))
        await publishing.wait()
        assert ended.state.terminal and ended.job_id in w0.job_tasks
        assert (await announce_to(w0, Identity.generate(), "new"))[1] is None  # nothing may go: refused
        assert w0.jobs.get(ended.job_id) is ended and ended.job_id in w0.job_tasks
        with trio.fail_after(10):
            await published.wait()  # its task ran to its end: not cancelled
        await wait_for(lambda: ended.job_id not in w0.job_tasks)
        assert (await announce_to(w0, Identity.generate(), "newer"))[1] is not None  # now it makes room
        assert ended.job_id not in w0.jobs and w0.jobs.get(live.job_id) is live


async def test_a_forgotten_job_is_rebuilt_off_the_event_loop_and_kept(tmp_path, tiny_model_dir, monkeypatch):
    """Review finding 5 (a): `job show` (and watch, bill, ledger) of a forgotten job replayed its whole
    stored history on the event loop, every time. Now it is rebuilt in the store's worker thread, and
    the last REBUILT_VIEWS rebuilt ended jobs are kept."""
    import agent.jobbook as jobbook

    monkeypatch.setattr(jobbook, "REBUILT_VIEWS", 2)
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        views = [(await announce_to(w0, Identity.generate(), f"job-{i}"))[1] for i in range(3)]
        for view in views:
            await end(w0, view)
            w0.forget_job(view.job_id)
        loop, threads = threading.current_thread(), []
        rebuild = w0.book.rebuild

        def rebuild_view(record):  # the real rebuild, noting the thread it runs in
            threads.append(threading.current_thread())
            return rebuild(record)

        monkeypatch.setattr(w0.book, "rebuild", rebuild_view)
        first = views[0].job_id.hex()[:12]
        for _ in range(3):  # `job watch` polls
            shown = await control.HANDLERS["job.show"](w0, first)
            assert shown["id"] == views[0].job_id.hex() and shown["state"] == "CANCELLED"
        assert len(threads) == 1 and threads[0] is not loop
        for view in views[1:]:
            assert (await control.HANDLERS["job.show"](w0, view.job_id.hex()[:12]))["state"] == "CANCELLED"
        assert len(threads) == 3 and loop not in threads
        assert list(w0.book.rebuilt) == [v.job_id for v in views[1:]]  # the least recently shown went
        await control.HANDLERS["job.show"](w0, first)
        assert len(threads) == 4


async def test_a_forgotten_job_leaves_nothing_in_the_roles(tmp_path, tiny_model_dir):
    """Review finding 5 (b): forgetting a job left the coordinator's, the worker's and the ledger
    sync's per-job state behind, so memory was not bounded by the jobs followed."""
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        (_, gone), (_, kept) = [await announce_to(w0, Identity.generate(), f"job-{i}") for i in range(2)]
        claimant = Identity.generate().peer_id
        for view in (gone, kept):
            job = view.job_id
            assert not w0.is_coordinator(view)  # within the grace period: the claim is kept for take_over
            await w0.coordinator.on_claim(view, m.ShardClaim(job, 1, 0), claimant)
            assert claimant in w0.coordinator._early[job]
            coordinator, worker = w0.coordinator, w0.worker
            coordinator._validation[job] = tmp_path / "validation.jsonl"
            coordinator._claims[job] = [(claimant, 1, 0)]
            coordinator.accepted_adapters[(job, 1, 0)] = (tmp_path / "adapter", 10)
            coordinator._refused[(job, claimant)] = "test"
            coordinator._initial[(job, 1)] = ({}, {}, {})
            worker._last_claim[job] = (w0.clock(), 1, False)
            worker._market_logged[job] = "test"
            w0.ledger_service.ended[job] = w0.clock()
        await end(w0, gone)
        w0.forget_job(gone.job_id)
        job = gone.job_id
        coordinator, worker = w0.coordinator, w0.worker
        for per_job in (coordinator._early, coordinator._validation, coordinator._claims,
                        worker._last_claim, worker._market_logged, worker.candidates, w0.ledger_service.ended):
            assert job not in per_job
        for keyed in (coordinator.accepted_adapters, coordinator._refused, coordinator._initial):
            assert not [k for k in keyed if k[0] == job]
        # the job still followed keeps its own
        assert kept.job_id in coordinator._early and (kept.job_id, 1, 0) in coordinator.accepted_adapters
        assert kept.job_id in worker._last_claim and kept.job_id in w0.ledger_service.ended


async def test_a_job_forgotten_a_moment_ago_is_followed_again_once_its_topic_is_left(tmp_path, tiny_model_dir):
    """Review finding 8: a job forgotten and announced again before the background leave() ran got
    the old subscription back, closed under its new reader (or its new validator removed). Now it
    is not followed again until its topic is left; then it is, with a subscription of its own."""
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        (w0,) = net.workers
        gossip, announcer = w0.net.gossip, Identity.generate()
        terms, view = await announce_to(w0, announcer, "again")
        topic = m.job_topic(view.job_id)
        await end(w0, view)
        # its terminal job row was lost (a full disk, say): the store does not hold it as ended
        await trio.to_thread.run_sync(w0.store.flush, limiter=w0.store_limiter)
        w0.store.update_job(view.job_id, w0.clock(), state="TRAINING")
        w0.forget_job(view.job_id)
        assert (await announce_to(w0, announcer, "again"))[1] is None  # its topic is still being left
        await wait_for(lambda: view.job_id not in w0.book.leaving and topic not in gossip._subscriptions)
        again = (await announce_to(w0, announcer, "again"))[1]
        assert again is not None and again is not view and w0.jobs[view.job_id] is again
        await trio.sleep(0.5)  # anything left of the old subscription's leave would have run by now
        subscription = gossip._subscriptions.get(topic)
        assert subscription is not None and topic in gossip.pubsub.topic_ids
        assert topic in gossip.pubsub.topic_validators
        assert not subscription._send._closed  # open: its reader reads on
