"""A mirror that missed a lease asks the signer of the worker messages it holds (IPIP-0004 §11.1).

Before, only a held *decision* asked for history, from the submitter: a worker's mirror that missed
another worker's lease held that worker's checkpoints and kept claiming its shard until a decision it
could not apply came, about a shard's training time later (IPIP-0009: claims per job 383 -> 630 on the
real mirror). The rule (protocol/resync.repair_sources, its vectors) and two real agents on loopback:
the one that missed the lease (with ``repair_from_senders`` on: it is off by default, IPIP-0004 §11.1)
fetches the other's history over the job-sync protocol and applies the lease and the held checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import trio

from agent.net.gossip import Received
from agent.node import PeerInfo
from protocol import messages as m
from protocol import state as st
from protocol.election import Coordination
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.mirror import JobMirror
from protocol.resync import got_further, holds_decisions, needs_resync, repair_sources
from scripts.make_envelope_vectors import sample_capability, sample_terms
from tests.roles.conftest import network

VECTORS = Path(__file__).resolve().parents[2] / "ipips" / "vectors" / "resync.json"
SUBMITTER, COORD = Identity(bytes([1]) * 32), Identity(bytes([3]) * 32)
TERMS = dataclasses.replace(sample_terms(SUBMITTER), deadline=0)  # no deadline: it lives until ended
JOB = TERMS.job_id()


def _message(kind: str, worker: str):
    cid = TERMS.shards[0].cid
    return {"lease": m.ShardLease(JOB, 1, 0, 1, worker, 1, 2e9, None),
            "ckpt": m.CheckpointCommit(JOB, 1, 0, 1, 10, 0, bytes(32), bytes(32), 1.0, None),
            "report": m.ShardReport(JOB, 1, 0, 1, cid, cid, bytes(32), 1, 4, 32, 1.0, {}),
            "release": m.ShardRelease(JOB, 1, 0, 1, "bye"),
            "verdict": m.Verdict(JOB, 1, 0, 1, worker, 1, True, "ok", (0,))}[kind]


def test_the_rules_vectors():
    """ipips/vectors/resync.json: what the mirror holds, since when, by whom -> rebuild, and whom to ask."""
    cases = json.loads(VECTORS.read_text())["cases"]
    assert len(cases) >= 6
    for case in cases:
        view = JobMirror(TERMS, 0.0, case["me"])
        view.resynced_at = case.get("resynced_at")
        for held in case["pending"]:
            view.pending.append((held["seen"], _message(held["kind"], held["signer"]), held["signer"], None))
        if case.get("ended"):
            from dataclasses import replace

            view.state = replace(view.state, phase=st.JobPhase.DONE)
        eligible = frozenset(case["eligible"])
        assert needs_resync(view, eligible, case["now"]) is case["needs_resync"], case["name"]
        assert list(repair_sources(view, case["now"])) == case["repair_sources"], case["name"]
        assert holds_decisions(view, eligible) is case["holds_decisions"], case["name"]


def test_the_further_vectors():
    """ipips/vectors/resync.json "further": when a submitter keeps a mirror rebuilt from its coordinator's history."""
    def mirror(progress: dict) -> JobMirror:
        view = JobMirror(TERMS, 0.0, "S")
        shards = tuple(dataclasses.replace(s, phase=st.ShardPhase.ACCEPTED) if i < progress["accepted"] else s
                       for i, s in enumerate(view.state.shards))
        view.state = dataclasses.replace(view.state, round=progress["round"], shards=shards,
                                         phase=st.JobPhase.DONE if progress["ended"] else st.JobPhase.TRAINING)
        return view

    cases = json.loads(VECTORS.read_text())["further"]
    assert len(cases) >= 6
    for case in cases:
        assert got_further(mirror(case["rebuilt"]), mirror(case["ours"])) is case["got_further"], case["name"]


def received(identity: Identity, message, at: float) -> Received:
    opened = open_envelope(seal(identity, message, now=at), now=at)
    return Received(m.job_topic(JOB), opened.message, opened.envelope, identity.peer_id)


@pytest.mark.network
async def test_a_worker_that_missed_a_lease_gets_it_from_the_lease_holder(tmp_path, tiny_model_dir):
    # the repair is the operator's choice (repair_from_senders, off by default): w0 turned it on
    async with network(tmp_path, tiny_model_dir, workers=2, overrides={0: {"repair_from_senders": True}}) as net:
        w0, w1 = net.workers
        assert w0.jobclock.repair and not w1.jobclock.repair
        now = time.time()
        views = {}
        for agent in (w0, w1):  # both follow the job; COORD (not running) coordinates term 1
            agent.store.add_job(TERMS, "worker", now - 100)
            agent.peers[COORD.peer_id] = PeerInfo(now, capability=sample_capability(), live_since=now - 100)
            agent.peers[SUBMITTER.peer_id] = PeerInfo(now, live_since=now - 100)
            view = JobMirror(TERMS, now - 100, agent.peer_id)
            view.coordination = Coordination(JOB, 1, COORD.peer_id)
            agent.jobs[JOB] = view
            views[agent] = view
        lease = received(COORD, m.ShardLease(JOB, 1, 0, 1, w1.peer_id, 1, now + 600, None), now - 10)
        checkpoint = received(w1.identity, m.CheckpointCommit(JOB, 1, 0, 1, 10, 0, bytes(32), bytes(32), 1.0, None),
                              now - 9)
        await w1.on_job_message(views[w1], lease)  # w1 holds its lease and its first checkpoint
        await w1.on_job_message(views[w1], checkpoint)
        await w0.on_job_message(views[w0], checkpoint)  # w0 missed the lease: the checkpoint is held
        assert views[w0].shard(0).phase is st.ShardPhase.OPEN and len(views[w0].pending) == 1
        started = trio.current_time()
        # w0's own ticks: held over 5 s, its signer w1 is asked for its history (never the submitter)
        await w0.wait_until(lambda: views[w0].shard(0).phase is st.ShardPhase.LEASED and not views[w0].pending, 30)
        assert trio.current_time() - started < 20
        assert views[w0].shard(0).worker == w1.peer_id
        # kept as evidence, in the order they applied (the mirror changes before the store's write returns:
        # a clean-clone CI run under load read the store in between and found nothing yet)
        with trio.move_on_after(10):
            while [s.type for s in w0.store.envelopes(JOB, stored_order=True)][-2:] != ["lease", "ckpt"]:
                await trio.sleep(0.1)
        stored = [s.type for s in w0.store.envelopes(JOB, stored_order=True)]
        assert stored[-2:] == ["lease", "ckpt"]


@pytest.mark.network
async def test_a_lease_to_us_that_a_rebuild_brings_is_trained(tmp_path, tiny_model_dir):
    """IPIP-0004 §11: a worker's mirror rebuilt from the submitter's history holds a lease to that worker which it
    never received live (here: it missed it; in the scenario successor-same-term it refused it for its term).
    Nothing started it before (a lease reached the worker only as a live message): held unused until it ran out,
    30 s in that scenario, an hour by default. Now the rebuild hands it to the worker."""
    async with network(tmp_path, tiny_model_dir, workers=1) as net:
        submitter, w0 = net.submitter, net.workers[0]
        terms = dataclasses.replace(sample_terms(submitter.identity), deadline=0)
        job = terms.job_id()
        now = time.time()
        lease = m.ShardLease(job, 1, 0, 1, w0.peer_id, 1, now + 600, None)
        views = {}
        for agent, role in ((submitter, "submitter"), (w0, "worker")):  # COORD (not running) coordinates term 1
            agent.store.add_job(terms, role, now - 100)
            agent.peers[COORD.peer_id] = PeerInfo(now, capability=sample_capability(), live_since=now - 100)
            view = JobMirror(terms, now - 100, agent.peer_id)
            view.coordination = Coordination(job, 1, COORD.peer_id)
            agent.jobs[job] = view
            views[agent] = view
        w0.worker.candidates[job] = views[w0]  # a job it trains
        opened = open_envelope(seal(COORD, lease, now=now - 10), now=now - 10)
        await submitter.on_job_message(views[submitter], Received(m.job_topic(job), opened.message, opened.envelope,
                                                                   COORD.peer_id))  # stored: in its history
        assert views[submitter].shard(0).phase is st.ShardPhase.LEASED
        assert views[w0].shard(0).phase is st.ShardPhase.OPEN  # w0 missed it
        taken = []  # what the worker is handed (a fabricated job has no task scope to train it in)
        w0.worker.on_lease = lambda view, msg: taken.append((view, msg))
        await w0.jobclock._fetch_history(views[w0], ())  # the rebuild a diverged mirror asks for (JobClock.tick_job)
        assert views[w0].shard(0).phase is st.ShardPhase.LEASED and views[w0].shard(0).worker == w0.peer_id
        assert taken == [(views[w0], lease)]
