"""Verdicts of earlier terms (IPIP-0006 §1.3 rule 7), fed in the exact order that broke partition-heal.

Issue #17: the submitter held the term-2 coordinator's verdict (a verdict never moves a view to a higher
term); a term-3 lease then moved its view past term 2 and the held verdict was refused for good as
stale: its mirror kept the shard REPORTED (then reopened it) while every other mirror had accepted it.
"""

from protocol import messages as m
from protocol import state as st
from protocol.election import Coordination, rank_peers
from protocol.identity import Identity
from protocol.mirror import JobMirror
from scripts.make_envelope_vectors import sample_terms

SUBMITTER, W0, W1, W2, W3 = (Identity(bytes([i]) * 32) for i in (1, 20, 21, 22, 23))
TERMS = sample_terms(SUBMITTER)
JOB = TERMS.job_id()
NOW = 1_790_000_000.0
ELIGIBLE = frozenset({W0.peer_id, W1.peer_id, W2.peer_id, W3.peer_id})


def submitter_view() -> JobMirror:
    v = JobMirror(TERMS, NOW, me=SUBMITTER.peer_id)
    v.coordination = Coordination(JOB, 1, W0.peer_id)  # term 1: W0, elected after the grace period
    return v


def lease(shard, attempt, worker, term, rnd=1):
    return m.ShardLease(JOB, rnd, shard, attempt, worker.peer_id, term, NOW + 120, None)


def report(shard, attempt, rnd=1):
    cid = TERMS.shards[shard].cid
    return m.ShardReport(JOB, rnd, shard, attempt, cid, cid, bytes(32), 1, 4, 32, 1.0, {})


def verdict(shard, attempt, worker, term, accepted=True, rnd=1):
    return m.Verdict(JOB, rnd, shard, attempt, worker.peer_id, term, accepted, "ok", (0,))


def test_a_held_verdict_of_a_skipped_term_applies_once_a_later_term_moves_the_view_past_it():
    v = submitter_view()
    assert v.receive(lease(1, 1, W1, 1), W0.peer_id, NOW, ELIGIBLE).actions is not None
    assert v.receive(report(1, 1), W1.peer_id, NOW + 1, ELIGIBLE).actions is not None
    # W3 coordinates term 2 on the submitter's side of a partition; its verdict reaches us while our
    # view is still in term 1: held, the view does not move (rule 6)
    assert v.receive(verdict(1, 1, W1, 2), W3.peer_id, NOW + 2, ELIGIBLE).actions is None
    assert v.coordination.term == 1 and v.shard(1).phase is st.ShardPhase.REPORTED
    # a term-3 lease (W2 took over from W3) moves the view from term 1 to term 3: term 2 was skipped
    assert v.receive(lease(0, 1, W0, 3), W2.peer_id, NOW + 3, ELIGIBLE).actions is not None
    assert (v.coordination.term, v.coordination.coordinator) == (3, W2.peer_id)
    # the held term-2 verdict is not stale: it judged an attempt leased in term 1, and term 2 is one
    # our view never held; it applied on the way (before the fix it stayed held and expired)
    assert v.shard(1).phase is st.ShardPhase.ACCEPTED, (v.shard(1), v.pending)
    assert not v.pending and (1, 1, 1) in v.verdicts
    assert v.coordination.past == ((1, W0.peer_id),)  # the verdict never moved the view


def test_a_verdict_of_a_term_we_held_applies_only_from_that_terms_coordinator():
    v = submitter_view()
    v.receive(lease(1, 1, W1, 1), W0.peer_id, NOW, ELIGIBLE)
    v.receive(report(1, 1), W1.peer_id, NOW + 1, ELIGIBLE)
    v.receive(lease(0, 1, W0, 2), W2.peer_id, NOW + 2, ELIGIBLE)  # W0 deposed; W2 coordinates term 2
    assert (v.coordination.term, v.coordination.past) == (2, ((1, W0.peer_id),))
    # a term-1 verdict from W3, which never coordinated term 1 in our view: refused
    assert v.receive(verdict(1, 1, W1, 1), W3.peer_id, NOW + 3, ELIGIBLE).actions is None
    assert v.shard(1).phase is st.ShardPhase.REPORTED
    # the term-1 coordinator's own verdict, sent before it learned it was deposed: applied, view unmoved
    assert v.receive(verdict(1, 1, W1, 1), W0.peer_id, NOW + 4, ELIGIBLE).actions is not None
    assert v.shard(1).phase is st.ShardPhase.ACCEPTED and v.coordination.term == 2


def test_an_earlier_terms_verdict_never_judges_a_later_lease_nor_a_reopened_attempt():
    v = submitter_view()
    v.receive(lease(1, 1, W1, 1), W0.peer_id, NOW, ELIGIBLE)
    v.receive(report(1, 1), W1.peer_id, NOW + 1, ELIGIBLE)
    v.receive(lease(0, 1, W0, 2), W2.peer_id, NOW + 2, ELIGIBLE)
    # term 2's coordinator rejects attempt 1 and leases attempt 2 in term 2
    assert v.receive(verdict(1, 1, W1, 2, accepted=False), W2.peer_id, NOW + 3, ELIGIBLE).actions is not None
    assert v.receive(lease(1, 2, W3, 2), W2.peer_id, NOW + 4, ELIGIBLE).actions is not None
    v.receive(report(1, 2), W3.peer_id, NOW + 5, ELIGIBLE)
    # the deposed term-1 coordinator's late verdict on attempt 1: the state machine refuses it (stale attempt)
    assert v.receive(verdict(1, 1, W1, 1), W0.peer_id, NOW + 6, ELIGIBLE).actions is None
    # ... and its verdict on attempt 2, leased in term 2, is refused by rule 7 (a term-1 coordinator never saw it)
    assert v.receive(verdict(1, 2, W3, 1), W0.peer_id, NOW + 7, ELIGIBLE).actions is None
    assert (v.shard(1).phase, v.shard(1).attempt) == (st.ShardPhase.REPORTED, 2)


def test_a_verdict_of_a_skipped_term_signed_by_its_worker_or_an_ineligible_peer_is_refused():
    v = submitter_view()
    v.receive(lease(1, 1, W1, 1), W0.peer_id, NOW, ELIGIBLE)
    v.receive(report(1, 1), W1.peer_id, NOW + 1, ELIGIBLE)
    v.receive(lease(0, 1, W0, 3), W2.peer_id, NOW + 2, ELIGIBLE)
    outsider = Identity(bytes([99]) * 32)
    assert v.receive(verdict(1, 1, W1, 2), W1.peer_id, NOW + 3, ELIGIBLE).actions is None  # self-judged
    assert v.receive(verdict(1, 1, W1, 2), outsider.peer_id, NOW + 4, ELIGIBLE).actions is None  # not eligible
    assert v.shard(1).phase is st.ShardPhase.REPORTED


# -- late verdicts (IPIP-0004 §5), the other way partition-heal's submitter fell behind ------------


def test_a_verdict_arriving_just_after_our_verification_window_closed_is_still_taken():
    """On a loaded machine the submitter's window closed 0.1 s before the coordinator's verdict (given in
    its own window) arrived; the submitter reopened the shard, refused the verdict and then the round's
    aggregate for good. A verdict for the attempt the verification timer ended applies until a new lease."""
    v = submitter_view()
    lease_seconds = float(TERMS.lease_seconds)
    for shard, worker in ((0, W2), (1, W1)):
        v.receive(lease(shard, 1, worker, 1), W0.peer_id, NOW, ELIGIBLE)
        v.receive(report(shard, 1), worker.peer_id, NOW + 1, ELIGIBLE)
    v.receive(verdict(0, 1, W2, 1), W0.peer_id, NOW + 2, ELIGIBLE)
    assert v.tick(NOW + 1 + lease_seconds).changed  # shard 1's window closes here: reopened
    assert v.shard(1).phase is st.ShardPhase.OPEN
    actions = v.receive(verdict(1, 1, W1, 1), W0.peer_id, NOW + 1.1 + lease_seconds, ELIGIBLE).actions
    assert actions is not None and any(isinstance(a, st.Aggregate) for a in actions)
    assert (v.shard(1).phase, v.shard(1).worker) == (st.ShardPhase.ACCEPTED, W1.peer_id)
    assert v.state.phase is st.JobPhase.AGGREGATING


def _term2_history(coordinator, judge, other):
    """Term 1 (W0, later dead) leased shard 0 to term 2's coordinator and shard 1 to ``other``; in term 2
    the judge's verdict on the coordinator's own report comes first, then the coordinator's on shard 1."""
    return [
        (lease(0, 1, coordinator, 1), W0), (lease(1, 1, other, 1), W0),
        (report(0, 1), coordinator), (report(1, 1), other),
        (verdict(0, 1, coordinator, 2), judge),  # rule 6: the judge's verdict on the coordinator's report
        (verdict(1, 1, other, 2), coordinator),
    ]


def test_a_replayed_history_whose_term_opens_with_its_judges_verdict_keeps_the_terms_coordinator():
    # coordinator-crash on a loaded machine (CI): W0 coordinated term 1 and died; C took over in term 2
    # holding a report of its own, which J judged (rule 6) before C had decided anything in term 2.
    # Replayed history believes a verdict's higher term: J's verdict came first, so the replay took J
    # for term 2's coordinator and refused C's decisions (or read C's verdict on J as a judge's) -- the
    # rebuilt mirror (C's own, after its resync) no longer named C, nobody aggregated, the job failed.
    C, J = (p for p in rank_peers(JOB, {W1.peer_id, W2.peer_id}))  # a judge ranks after the coordinator
    C, J = (W1 if C == W1.peer_id else W2), (W1 if J == W1.peer_id else W2)
    for other in (W3, J):  # C's verdict on a third worker; on the judge itself (either could sign both)
        for me in (W3, C, J):
            v = JobMirror(TERMS, NOW, me=me.peer_id)
            for i, (msg, signer) in enumerate(_term2_history(C, J, other)):
                v.replay(msg, signer.peer_id, NOW + i)
            assert (v.coordination.term, v.coordination.coordinator) == (2, C.peer_id), (other, me)
            assert [v.shard(i).phase for i in (0, 1)] == [st.ShardPhase.ACCEPTED] * 2, (v.state, v.pending)
            assert not v.pending and v.term_from_verdict is None
    # the usual order (the coordinator's verdict opens the term) is unchanged
    history = _term2_history(C, J, W3)
    v = JobMirror(TERMS, NOW, me=W3.peer_id)
    for i, (msg, signer) in enumerate(history[:4] + [history[5], history[4]]):
        v.replay(msg, signer.peer_id, NOW + i)
    assert (v.coordination.term, v.coordination.coordinator) == (2, C.peer_id)
    assert [v.shard(i).phase for i in (0, 1)] == [st.ShardPhase.ACCEPTED] * 2
    # a provisional term moves only to the worker its verdict judged; a third peer's decision is refused
    v = JobMirror(TERMS, NOW, me=W0.peer_id)
    for i, (msg, signer) in enumerate(history[:5]):
        v.replay(msg, signer.peer_id, NOW + i)
    assert v.coordination.coordinator == J.peer_id and v.term_from_verdict == (2, J.peer_id, C.peer_id)
    assert v.receive(verdict(1, 1, W3, 2), W0.peer_id, NOW + 9, ELIGIBLE).actions is None
    assert v.coordination.coordinator == J.peer_id and v.shard(1).phase is st.ShardPhase.REPORTED
    assert v.receive(verdict(1, 1, W3, 2), C.peer_id, NOW + 9, ELIGIBLE).actions is not None
    assert v.coordination.coordinator == C.peer_id and v.shard(1).phase is st.ShardPhase.ACCEPTED
    # a decision no judge makes confirms the verdict's signer
    v = JobMirror(TERMS, NOW, me=W0.peer_id)
    for i, (msg, signer) in enumerate(history[:5] + [(lease(1, 1, W3, 2), J)]):
        v.replay(msg, signer.peer_id, NOW + i)
    assert v.coordination.coordinator == J.peer_id and v.term_from_verdict is None


def aggregate(rnd, term):
    return m.AggregatePublished(JOB, rnd, term, TERMS.shards[0].cid, "exact", (0, 1), 64, False)


def dead_coordinators_history():
    """What the term-2 coordinator (W1) stored of round 1 when the term-1 coordinator (W0) had leased both
    shards and died: W0's term-1 leases, the reports, W1's term-2 verdicts and aggregate; (signer, message)."""
    return [(W0, lease(0, 1, W2, 1)), (W0, lease(1, 1, W3, 1)), (W2, report(0, 1)), (W3, report(1, 1)),
            (W1, verdict(0, 1, W2, 2)), (W1, verdict(1, 1, W3, 2)), (W1, aggregate(1, 2))]


def test_a_restarted_submitter_takes_a_dead_coordinators_leases_from_its_successors_history():
    """IPIP-0006 §1.3 rule 9, the soak's fault: the submitter is killed 2 s after announcing, the term-1
    coordinator dies once it has leased, and the restarted submitter hears the term-2 coordinator (its
    heartbeat moves the view to term 2) before it catches up. As live messages, the dead coordinator's
    term-1 leases are stale, so nothing after them applies and the submitter stays in round 1 for good;
    vouched for by the history of its view's coordinator, they apply and the round is aggregated."""
    live = frozenset({W1.peer_id, W2.peer_id, W3.peer_id})  # W0 is dead
    v = JobMirror(TERMS, NOW, me=SUBMITTER.peer_id)
    v.observe_term(W1.peer_id, 2, NOW + 30, live)
    assert (v.coordination.term, v.coordination.coordinator) == (2, W1.peer_id)
    for signer, msg in dead_coordinators_history():  # as any peer's history (not vouched): refused, held
        v.receive(msg, signer.peer_id, NOW + 5, live, history=True)
    assert v.state.round == 1 and v.shard(0).phase is st.ShardPhase.OPEN and len(v.pending) == 7
    applied = [v.receive(msg, signer.peer_id, NOW + 5, live, history=True, vouched=True).changed
               for signer, msg in dead_coordinators_history()]
    assert all(applied), applied
    assert v.state.round == 2 and 1 in v.aggregates and (1, 0, 1) in v.verdicts
    assert not v.pending  # the copies held by the first pass are gone with it
    assert (v.coordination.term, v.coordination.coordinator) == (2, W1.peer_id)  # never moves the view


def test_a_vouched_history_outranks_the_submitters_own_record_of_an_earlier_term():
    """The scenario submitter-coordinator-down: back after the restart, the submitter formed a first view of
    its own over the peers it heard (term 1: W2; the others' term 1 was W0's, now dead), then a term-2 lease
    of W1 moved it. Its record says W2 held term 1, so rule 7 would refuse W0's term-1 leases; in W1's
    history (rule 9) they apply. The voucher never vouches for a verdict on its own work, and without the
    vouching history an earlier term's lease from a gone signer stays stale."""
    live = frozenset({W1.peer_id, W2.peer_id, W3.peer_id})
    v = JobMirror(TERMS, NOW, me=SUBMITTER.peer_id)
    v.coordination = Coordination(JOB, 1, W2.peer_id)
    v.observe_term(W1.peer_id, 2, NOW + 30, live)
    assert v.coordination.past == ((1, W2.peer_id),)
    assert v.receive(lease(1, 1, W3, 1), W0.peer_id, NOW + 2, live, history=True).actions is None  # stale
    assert v.receive(lease(1, 1, W3, 1), W0.peer_id, NOW + 2, live, history=True, vouched=True).changed
    assert v.receive(lease(0, 1, W1, 1), W0.peer_id, NOW + 2, live, history=True, vouched=True).changed
    v.receive(report(0, 1), W1.peer_id, NOW + 3, live, history=True, vouched=True)
    # W1 (the voucher) trained shard 0 in term 1: a term-1 verdict on it in W1's history is not taken
    assert v.receive(verdict(0, 1, W1, 1), W0.peer_id, NOW + 4, live, history=True, vouched=True).actions is None
    assert v.shard(0).phase is st.ShardPhase.REPORTED and v.shard(1).phase is st.ShardPhase.LEASED
