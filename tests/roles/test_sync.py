"""Job history for catching up (IPIP-0004 §11): what a peer serves, and what a peer accepts of it.

End to end (a worker joining after round 1, mirrors rebuilt after a partition) is in the harness
scenarios late-joiner and partition-heal.
"""

from __future__ import annotations

import pytest

from protocol.mirror import JobMirror
from agent.roles.sync import _replay, _verified, history_for
from protocol.resync import needs_resync
from agent.store import Store
from protocol import messages as m
from protocol.envelope import seal
from protocol.identity import Identity
from scripts.make_envelope_vectors import sample_terms

NOW = 1_790_000_000.0
SUBMITTER = Identity(bytes([1]) * 32)
COORD = Identity(bytes([3]) * 32)
WORKER = Identity(bytes([4]) * 32)
TERMS = sample_terms(SUBMITTER)
JOB = TERMS.job_id()


def lease(shard: int, term: int = 1, attempt: int = 1, who: Identity = COORD, at: float = NOW) -> bytes:
    return seal(who, m.ShardLease(JOB, 1, shard, attempt, WORKER.peer_id, term, at + 600, None), now=at)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "agent.sqlite3", SUBMITTER) as s:
        s.add_job(TERMS, "submitter", NOW)
        yield s


def test_history_leaves_out_claims_announcements_and_other_jobs(store):
    # the announcement (type 'job') was served and refused by every catch-up: a warning per resync
    other = sample_terms(Identity(bytes([9]) * 32)).job_id()
    store.record(lease(0), NOW)
    store.record(seal(WORKER, m.ShardClaim(JOB, 1, 1), now=NOW + 1), NOW + 1)
    store.record(seal(COORD, m.ShardLease(other, 1, 0, 1, WORKER.peer_id, 1, NOW + 600, None), now=NOW + 2), NOW + 2)
    store.record(lease(1, at=NOW + 3), NOW + 3)
    store.record(seal(SUBMITTER, m.JobAnnouncement.for_terms(TERMS), now=NOW + 4), NOW + 4)
    history = history_for(store, JOB)
    assert [m.ShardLease.TYPE] * 2 == [_verified([h], JOB)[0][0][1].envelope.type for h in history]
    assert history_for(store, bytes(32)) == []


def test_only_signed_envelopes_of_the_job_are_accepted_whatever_their_age():
    good = lease(0, at=NOW - 86_400)  # a day old: history is not held to the 300 s window
    tampered = bytearray(lease(1))
    tampered[-5] ^= 1
    other_job = seal(COORD, m.ShardLease(bytes(32), 1, 0, 1, WORKER.peer_id, 1, NOW, None), now=NOW)
    claim = seal(WORKER, m.ShardClaim(JOB, 1, 0), now=NOW)
    verified, refused = _verified([good, bytes(tampered), b"\xc1garbage", other_job, claim], JOB)
    assert [data for data, _ in verified] == [good]
    assert refused == 4


def test_history_replayed_into_a_fresh_mirror_reaches_the_same_state():
    view = JobMirror(TERMS, NOW, WORKER.peer_id)
    for data, opened in _verified([lease(0), lease(1, at=NOW + 1)], JOB)[0]:
        _replay(view, opened)
    assert [s.phase.value for s in view.state.shards[:2]] == ["LEASED", "LEASED"]
    assert view.coordination.coordinator == COORD.peer_id and view.coordination.term == 1


def test_a_held_decision_of_an_eligible_coordinator_triggers_a_rebuild_an_attackers_does_not():
    view = JobMirror(TERMS, NOW, WORKER.peer_id)
    mallory = Identity(bytes([7]) * 32)
    spoofed = m.ShardLease(JOB, 2, 0, 1, mallory.peer_id, 9, NOW + 600, None)
    view.pending.append((NOW, spoofed, mallory.peer_id, None))
    eligible = frozenset({COORD.peer_id})
    assert not needs_resync(view, eligible, NOW + 60)
    view.pending.append((NOW, m.ShardLease(JOB, 2, 0, 1, WORKER.peer_id, 2, NOW + 600, None), COORD.peer_id, None))
    assert not needs_resync(view, eligible, NOW + 1)  # held briefly: gossip reorders
    assert needs_resync(view, eligible, NOW + 6)
    view.coordination = view.coordination.check_message(COORD.peer_id, 3, eligible)  # our view: term 3
    assert needs_resync(view, eligible, NOW + 60)  # a term-2 decision held: our term may be the wrong one


def test_no_rebuild_of_an_ended_job_nor_again_for_what_a_rebuild_left_held():
    """Issue 21 §3: a DONE job's mirror, or one whose held decisions a rebuild did not make apply, was
    rebuilt every RESYNC_INTERVAL forever (a restarted worker: '26 held', every 15 s for 12 minutes)."""
    from dataclasses import replace as dc_replace

    from protocol import state as st

    view = JobMirror(TERMS, NOW, WORKER.peer_id)
    eligible = frozenset({COORD.peer_id})
    view.pending.append((NOW, m.ShardLease(JOB, 2, 0, 1, WORKER.peer_id, 2, NOW + 600, None), COORD.peer_id, None))
    assert needs_resync(view, eligible, NOW + 6)
    view.resynced_at = NOW + 6  # a rebuild ran: what was held before it does not ask for another
    assert not needs_resync(view, eligible, NOW + 60)
    view.pending.append((NOW + 7, m.ShardLease(JOB, 2, 1, 1, WORKER.peer_id, 2, NOW + 600, None), COORD.peer_id, None))
    assert needs_resync(view, eligible, NOW + 60)  # held since: a new divergence
    view.state = dc_replace(view.state, phase=st.JobPhase.DONE)
    assert not needs_resync(view, eligible, NOW + 60)  # an ended job's history changes nothing


def test_a_submitters_job_with_nothing_applied_for_long_is_stalled_and_asks_its_peers():
    """The soak: a submitter killed twice while coordinators failed over missed the leases that spent a
    shard's attempts; its peers ended the job FAILED and nobody acted for it again, while its own mirror
    said TRAINING for ever. A submitter's unended job with nothing applied for long now catches up."""
    from protocol.resync import STALL_SECONDS, stalled

    view = JobMirror(TERMS, NOW, SUBMITTER.peer_id)
    wait = max(STALL_SECONDS, 2.0 * TERMS.lease_seconds)
    assert not stalled(view, SUBMITTER.peer_id, NOW + wait - 1)
    assert stalled(view, SUBMITTER.peer_id, NOW + wait + 1)
    assert not stalled(view, WORKER.peer_id, NOW + wait + 1)  # only the submitter's own job
    for data, opened in _verified([lease(0, at=NOW + wait)], JOB)[0]:
        view.receive(opened.message, opened.envelope.signer, NOW + wait, frozenset({COORD.peer_id}), data)
    assert not stalled(view, SUBMITTER.peer_id, NOW + wait + 1)  # a message applied: it moves


def test_our_coordinators_decision_in_the_lower_term_it_claims_applies_once_its_claim_is_heard():
    """IPIP-0006 §1.3 rule 11 in a mirror: our view named COORD in term 2 (it counted a dead coordinator's term);
    COORD's own view numbers its tenure 1. Its term-1 lease is held until its heartbeat claims term 1, then applies
    without moving the view; for rule 10 that claim counts (the scenario successor-same-term, agents)."""
    view = JobMirror(TERMS, NOW, WORKER.peer_id)
    dead = Identity(bytes([5]) * 32).peer_id
    eligible = frozenset({COORD.peer_id})
    view.coordination = view.coordination.check_message(dead, 1, {dead})._moved(2, COORD.peer_id)
    lease_msg = m.ShardLease(JOB, 1, 0, 1, WORKER.peer_id, 1, NOW + 600, None)
    assert not view.receive(lease_msg, COORD.peer_id, NOW, eligible).applied  # stale for now: held
    assert view.pending and view.claimed_at(COORD.peer_id, 2) is None
    out = view.observe_term(COORD.peer_id, 1, NOW + 1, eligible)
    assert [type(msg).__name__ for msg, _ in out.applied] == ["ShardLease"]
    assert view.state.shards[0].phase.value == "LEASED" and not view.pending
    assert (view.coordination.term, view.coordination.coordinator) == (2, COORD.peer_id)
    assert view.claimed_at(COORD.peer_id, 2) == NOW + 1  # it acts: rule 10 does not depose it
    assert view.observe_term(COORD.peer_id, 1, NOW + 2, eligible).applied == ()  # (nothing more held)
    # a claim counts within the protocol's silence window (30 s): a coordinator that stopped claiming claims nothing
    late = m.ShardLease(JOB, 1, 1, 1, Identity(bytes([8]) * 32).peer_id, 1, NOW + 600, None)  # (another worker)
    assert not view.receive(late, COORD.peer_id, NOW + 2 + 31, eligible).applied
    assert view.receive(late, COORD.peer_id, NOW + 2 + 29, eligible).applied
    # another peer's claim of a lower term is no claim of ours, and its decisions stay stale
    other = Identity(bytes([6]) * 32).peer_id
    view.observe_term(other, 1, NOW + 3, eligible | {other})
    assert view.claimed_at(other, 2) is None
    assert not view.receive(m.ShardLease(JOB, 1, 1, 1, WORKER.peer_id, 1, NOW + 600, None), other, NOW + 3,
                            eligible | {other}).applied
