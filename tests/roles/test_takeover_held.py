"""A coordinator elected by its own tick applies what was held for its term (IPIP-0006 §1.3 rule 6).

coordinator-crash failed on CI (a loaded machine): the term-1 coordinator died; the next peer by
rank took over in term 2 holding a report of its own. Its judge moved to term 2 first and judged that
report at once; the verdict reached the new coordinator while its view was still in term 1, so it was
held (a verdict never moves a view). The new coordinator's own election tick then moved its view to
term 2 -- and nothing retried what was held (only a coordinator's heartbeat, never our own, or
another message that applied did). Every shard was reported, so nothing else came: its mirror stayed
TRAINING while the submitter's was AGGREGATING, nobody aggregated, and the job failed.

Real parts: a real Agent (not on a network) with its SQLite store, fed real signed envelopes through
the job topic's code path, and driven by one real election tick (``JobClock.tick_job``, agent/jobclock.py).
"""

from __future__ import annotations

import trio

from agent.net.gossip import Received
from agent.node import Agent, AgentConfig, PeerInfo
from protocol.mirror import JobMirror
from agent.store import Store
from protocol import messages as m
from protocol import state as st
from protocol.election import Coordination, rank_peers
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_capability, sample_terms

SUBMITTER, DEAD = Identity(bytes([1]) * 32), Identity(bytes([40]) * 32)
TERMS = sample_terms(SUBMITTER)
JOB = TERMS.job_id()
NOW = 1_790_000_000.0
# the next coordinator (ME) and its judge (JUDGE): the judge ranks after it for this job
ME, JUDGE = sorted((Identity(bytes([41]) * 32), Identity(bytes([42]) * 32)),
                   key=lambda i: rank_peers(JOB, {Identity(bytes([41]) * 32).peer_id,
                                                 Identity(bytes([42]) * 32).peer_id}).index(i.peer_id))


def received(identity: Identity, message, at: float) -> Received:
    opened = open_envelope(seal(identity, message, now=at), now=at)
    return Received(m.job_topic(JOB), opened.message, opened.envelope, identity.peer_id)


def test_our_own_election_tick_applies_the_judges_verdict_held_for_our_term(tmp_path):
    clock = [NOW]
    agent = Agent(ME, AgentConfig(home=tmp_path, can_coordinate=True), clock=lambda: clock[0])
    agent.store = Store.in_data_dir(tmp_path, ME)
    agent.store.add_job(TERMS, "worker", NOW - 100)
    agent.capabilities.published = sample_capability()
    agent.peers[SUBMITTER.peer_id] = PeerInfo(NOW, live_since=NOW - 100)
    agent.peers[JUDGE.peer_id] = PeerInfo(NOW, capability=sample_capability(), live_since=NOW - 100)
    agent.peers[DEAD.peer_id] = PeerInfo(NOW - 100, capability=sample_capability(), live_since=NOW - 200)
    view = JobMirror(TERMS, NOW - 100, ME.peer_id)
    view.coordination = Coordination(JOB, 1, DEAD.peer_id)  # term 1's coordinator, silent since
    agent.jobs[JOB] = view
    cid = TERMS.shards[0].cid
    report = m.ShardReport(JOB, 1, 0, 1, cid, cid, bytes(32), 1, 4, 32, 1.0, {})
    verdict = m.Verdict(JOB, 1, 0, 1, ME.peer_id, 2, True, "ok", (0,))

    async def main() -> None:
        await agent.on_job_message(view, received(DEAD, m.ShardLease(JOB, 1, 0, 1, ME.peer_id, 1, NOW + 600, None),
                                                  NOW - 99))
        await agent.on_job_message(view, received(ME, report, NOW - 1))
        await agent.on_job_message(view, received(JUDGE, verdict, NOW))  # the judge is in term 2 already
        assert view.shard(0).phase is st.ShardPhase.REPORTED and len(view.pending) == 1
        assert view.coordination.term == 1
        clock[0] = NOW + 0.5
        await agent.jobclock.tick_job(view, clock[0])  # our own tick: DEAD is silent, we take term 2

    trio.run(main)
    assert (view.coordination.term, view.coordination.coordinator) == (2, ME.peer_id)
    assert view.shard(0).phase is st.ShardPhase.ACCEPTED, view.pending
    assert not view.pending
    stored = [s.type for s in agent.store.envelopes(JOB, stored_order=True)]
    assert stored[-1] == "verdict"  # kept as evidence once it applied
    agent.store.close()
