"""The job mirror copes with gossip's lack of order: refused messages are held and retried."""

from protocol import messages as m
from protocol import state as st
from protocol.identity import Identity
from protocol.mirror import PENDING_SECONDS, JobMirror
from scripts.make_envelope_vectors import sample_terms

SUBMITTER, COORD, W1, W2 = (Identity(bytes([i]) * 32) for i in (1, 11, 12, 13))
TERMS = sample_terms(SUBMITTER)
JOB = TERMS.job_id()
ELIGIBLE = frozenset({COORD.peer_id})
NOW = 1_790_000_000.0


def view() -> JobMirror:
    return JobMirror(TERMS, NOW, me=SUBMITTER.peer_id)


def lease(shard, attempt, worker):
    return m.ShardLease(JOB, 1, shard, attempt, worker.peer_id, 1, NOW + 120, None)


def test_a_lease_that_overtakes_the_release_it_depends_on_is_applied_once_the_release_arrives():
    v = view()
    first = v.receive(lease(0, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    assert first.actions is not None
    # attempt 2 arrives before W1's release of attempt 1: refused for now, held
    held = v.receive(lease(0, 2, W2), COORD.peer_id, NOW + 1, ELIGIBLE)
    assert held.actions is None and held.applied == () and held.evidence == ()
    assert v.shard(0).worker == W1.peer_id and len(v.pending) == 1
    outcome = v.receive(m.ShardRelease(JOB, 1, 0, 1, "bye"), W1.peer_id, NOW + 2, ELIGIBLE, b"release")
    assert any(isinstance(a, st.PublishLease) and a.attempt == 2 for a in outcome.actions), outcome
    assert (v.shard(0).phase, v.shard(0).attempt, v.shard(0).worker) == (st.ShardPhase.LEASED, 2, W2.peer_id)
    assert not v.pending
    # the caller reacts to the held lease too (a lease for us must start training)
    applied = [msg for msg, _ in first.applied + outcome.applied]
    assert [type(x).__name__ for x in applied] == ["ShardLease", "ShardRelease", "ShardLease"]
    assert applied[-1].attempt == 2 and outcome.evidence == (b"release",)  # (the held lease came without bytes)
    assert v.tick(NOW + 3).applied == ()  # what was collected is not handed out again


def test_a_verdict_before_its_report_and_duplicates_stay_harmless():
    v = view()
    v.receive(lease(1, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    report = m.ShardReport(JOB, 1, 1, 1, TERMS.shards[1].cid, TERMS.shards[1].cid, bytes(32), 1, 4, 32, 1.0, {})
    verdict = m.Verdict(JOB, 1, 1, 1, W1.peer_id, 1, True, "ok", (0,))
    assert v.receive(verdict, COORD.peer_id, NOW + 1, ELIGIBLE).actions is None  # no report yet
    v.receive(report, W1.peer_id, NOW + 2, ELIGIBLE)
    assert v.shard(1).phase is st.ShardPhase.ACCEPTED and not v.pending
    # a duplicate report is refused and held until it expires, never applied twice
    assert v.receive(report, W1.peer_id, NOW + 3, ELIGIBLE).actions is None
    assert v.shard(1).phase is st.ShardPhase.ACCEPTED
    v.receive(lease(0, 1, W2), COORD.peer_id, NOW + PENDING_SECONDS + 10, ELIGIBLE)
    assert not v.pending, "held messages expire with the envelope window"


def test_after_a_failover_the_coordinators_verdict_on_its_own_report_is_refused_and_the_judges_applied():
    """IPIP-0006 §1.3 rule 6: W1 held a lease of term 1 and coordinates term 2; its own verdict on its
    report is never applied, the judge's (another eligible peer, in term 2) is."""
    from protocol.election import Coordination

    v = view()
    eligible = frozenset({COORD.peer_id, W1.peer_id, W2.peer_id})
    v.receive(lease(0, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    report = m.ShardReport(JOB, 1, 0, 1, TERMS.shards[0].cid, TERMS.shards[0].cid, bytes(32), 1, 4, 32, 1.0, {})
    v.receive(report, W1.peer_id, NOW + 1, eligible)
    v.coordination = Coordination(JOB, 2, W1.peer_id)  # COORD fell silent; W1 took over
    own = m.Verdict(JOB, 1, 0, 1, W1.peer_id, 2, True, "I like it", (0,))
    assert v.receive(own, W1.peer_id, NOW + 2, eligible).actions is None
    assert v.shard(0).phase is st.ShardPhase.REPORTED and v.refused["self-judged"] == 1
    judged = m.Verdict(JOB, 1, 0, 1, W1.peer_id, 2, True, "replayed", (0,))
    assert v.receive(judged, W2.peer_id, NOW + 3, eligible - {COORD.peer_id}).actions is not None
    assert v.shard(0).phase is st.ShardPhase.ACCEPTED and v.coordination.coordinator == W1.peer_id


def test_a_judges_verdict_ahead_of_our_view_waits_for_the_term_and_never_crowns_the_judge():
    """Found by the coordinator-judged scenario: the judge's term-2 verdict reached the submitter while
    its view was still in term 1, and it adopted the judge as term 2's coordinator (then refused the
    real coordinator's aggregate for good). A verdict never moves the view; it waits for the term."""
    v = view()
    eligible = frozenset({COORD.peer_id, W1.peer_id, W2.peer_id})
    v.receive(lease(0, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    report = m.ShardReport(JOB, 1, 0, 1, TERMS.shards[0].cid, TERMS.shards[0].cid, bytes(32), 1, 4, 32, 1.0, {})
    v.receive(report, W1.peer_id, NOW + 1, eligible)
    # COORD died; W1 coordinates term 2 and W2 judges W1's report, before we heard of term 2
    judged = m.Verdict(JOB, 1, 0, 1, W1.peer_id, 2, True, "replayed", (0,))
    assert v.receive(judged, W2.peer_id, NOW + 2, eligible).actions is None
    assert (v.coordination.term, v.coordination.coordinator) == (1, COORD.peer_id)  # the judge is not crowned
    assert v.shard(0).phase is st.ShardPhase.REPORTED
    # W1's first message of term 2 (a lease of shard 1) moves the view; the held verdict applies with it
    v.receive(m.ShardLease(JOB, 1, 1, 1, W2.peer_id, 2, NOW + 120, None), W1.peer_id, NOW + 3, eligible)
    assert (v.coordination.term, v.coordination.coordinator) == (2, W1.peer_id)
    assert v.shard(0).phase is st.ShardPhase.ACCEPTED and v.shard(1).phase is st.ShardPhase.LEASED


def test_an_aggregate_whose_final_flag_breaks_the_rounds_or_stop_rule_is_refused():
    """IPIP-0006 §2.6: final exactly at the last round, or when the job's stop rule holds on the signed losses."""
    import dataclasses

    def accepted_all(v, job):
        for shard in range(len(TERMS.shards)):
            worker = W1 if shard % 2 else W2
            v.receive(m.ShardLease(job, 1, shard, 1, worker.peer_id, 1, NOW + 120, None), COORD.peer_id, NOW, ELIGIBLE)
            v.receive(m.ShardReport(job, 1, shard, 1, TERMS.shards[shard].cid, TERMS.shards[shard].cid, bytes(32),
                                  1, 4, 32, 1.0, {}), worker.peer_id, NOW, ELIGIBLE)
            v.receive(m.Verdict(job, 1, shard, 1, worker.peer_id, 1, True, "ok", (0,)), COORD.peer_id, NOW, ELIGIBLE)
        assert v.state.phase is st.JobPhase.AGGREGATING

    cid = TERMS.shards[0].cid
    early = m.AggregatePublished(JOB, 1, 1, cid, "exact", tuple(range(len(TERMS.shards))), 8, True, 0.4)
    on_time = dataclasses.replace(early, final=False)
    assert TERMS.rounds > 1 and TERMS.stop is None
    v = view()
    accepted_all(v, JOB)
    assert v.receive(early, COORD.peer_id, NOW + 1, ELIGIBLE).actions is None and v.refused["final-flag"] == 1
    assert v.receive(on_time, COORD.peer_id, NOW + 2, ELIGIBLE).actions is not None and v.state.round == 2
    # with a stop rule that holds (0.4 < 0.5), only the final flag is right, and the job ends in round 1
    stopping = dataclasses.replace(TERMS, stop=m.StopTerms(0.5, 0), validation_cid=cid)
    for message, applies in ((on_time, False), (early, True)):
        w = JobMirror(stopping, NOW, me=SUBMITTER.peer_id)
        accepted_all(w, stopping.job_id())
        message = dataclasses.replace(message, job_id=stopping.job_id())
        assert (w.receive(message, COORD.peer_id, NOW + 1, ELIGIBLE).actions is not None) is applies
    assert w.state.phase is st.JobPhase.DONE and w.state.round == 1


def test_two_coordinators_of_one_term_settle_on_the_first_by_rank():
    """IPIP-0006 §1.3 rule 8: W1 and W2 each elected themselves in term 1 (each lacked the other's
    capability). A heartbeat term of the one that ranks first moves every view to it; the other's
    lease of the term is then refused, the first's applies."""
    from protocol.election import Coordination, rank_peers

    first, second = (p for p in rank_peers(JOB, (W1.peer_id, W2.peer_id)))
    v = JobMirror(TERMS, NOW, me=second)  # the second's own view: it believes it coordinates term 1
    v.coordination = Coordination(JOB, 1, second)
    eligible = frozenset({first, second})
    assert not v.observe_term(second, 1, NOW, eligible).changed
    v.observe_term(first, 1, NOW + 1, eligible)
    assert (v.coordination.term, v.coordination.coordinator) == (1, first)
    v.observe_term(second, 1, NOW + 2, eligible)  # the second's claim no longer moves it back
    assert v.coordination.coordinator == first
    stale = m.ShardLease(JOB, 1, 0, 1, COORD.peer_id, 1, NOW + 120, None)  # (to a third peer)
    assert v.receive(stale, second, NOW + 3, eligible).actions is None  # the term is the first's now
    assert v.receive(stale, first, NOW + 4, eligible).actions is not None
    w = JobMirror(TERMS, NOW, me=SUBMITTER.peer_id)  # a third view that held the second: it moves too
    w.coordination = Coordination(JOB, 1, second)
    assert w.observe_term(first, 1, NOW + 1, frozenset({second})).actions is None  # not eligible here: ignored
    assert w.coordination.coordinator == second
    w.observe_term(first, 1, NOW + 2, eligible)
    assert w.coordination.coordinator == first


def test_a_mirror_rebuilt_from_history_keeps_that_history_as_evidence():
    """adopt's outcome carries the replayed history's envelopes (then what held messages did), so a
    resync stores what the rebuilt mirror holds (the sim found it stored none)."""
    from protocol.mirror import Outcome

    live = view()
    fresh = view()
    history = Outcome.join([fresh.replay(lease(0, 1, W1), COORD.peer_id, NOW, b"lease-1"),
                            fresh.replay(lease(1, 1, W2), COORD.peer_id, NOW + 1, b"lease-2")])
    outcome = live.adopt(fresh, history, NOW + 2, ELIGIBLE)
    assert outcome.evidence == (b"lease-1", b"lease-2")
    assert live.shard(0).worker == W1.peer_id and live.shard(1).worker == W2.peer_id


def test_history_received_at_its_signed_time_leaves_held_live_messages_for_the_real_now():
    """A submitter catching up receives stored messages at their signed (past) times; a live lease held
    meanwhile is tried at the real now, so its clock starts now, not at the history's time."""
    v = view()
    v.receive(lease(0, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    live_now = NOW + 60  # (within attempt 1's lease)
    held = v.receive(lease(0, 2, W2), COORD.peer_id, live_now, ELIGIBLE)  # live: waits for the release
    assert held.actions is None and len(v.pending) == 1
    past = v.receive(m.ShardRelease(JOB, 1, 0, 1, "bye"), W1.peer_id, NOW + 10, ELIGIBLE, history=True)
    assert [type(x).__name__ for x, _ in past.applied] == ["ShardRelease"] and len(v.pending) == 1
    later = v.retry(live_now + 1, ELIGIBLE)
    assert [type(x).__name__ for x, _ in later.applied] == ["ShardLease"]
    assert v.shard(0).attempt == 2 and v.shard(0).expires_at == live_now + 1 + float(TERMS.lease_seconds)


def test_held_messages_past_their_window_are_dropped_at_a_tick():
    v = view()
    v.receive(m.ShardLease(JOB, 2, 0, 1, W2.peer_id, 1, NOW + 120, None), COORD.peer_id, NOW, ELIGIBLE)  # round 2
    assert len(v.pending) == 1
    v.tick(NOW + PENDING_SECONDS - 1)
    assert len(v.pending) == 1
    v.tick(NOW + PENDING_SECONDS + 1)
    assert not v.pending and v.refused["pending-expired"] == 1


def test_a_lease_naming_another_attempt_than_ours_is_held_not_renumbered():
    """IPIP-0004 §5 "A lease's attempt": this mirror missed attempt 1's lease; attempt 2's is held (it
    was applied as attempt 1 before, and its worker's reports were refused for good), and applies once
    the missing lease and its release arrive."""
    v = view()
    held = v.receive(lease(0, 2, W2), COORD.peer_id, NOW, ELIGIBLE)
    assert held.actions is None and len(v.pending) == 1 and v.refused["lease-attempt"] == 1
    assert v.shard(0).attempt == 0 and (1, 0, 2) not in v.leases
    v.receive(lease(0, 1, W1), COORD.peer_id, NOW + 1, ELIGIBLE)
    v.receive(m.ShardRelease(JOB, 1, 0, 1, "bye"), W1.peer_id, NOW + 2, ELIGIBLE)
    assert (v.shard(0).attempt, v.shard(0).worker) == (2, W2.peer_id) and not v.pending


def test_a_revoke_applies_from_the_coordinator_only_and_the_next_lease_follows_it():
    """IPIP-0004 §5.3: a coordinator ends a silent holder's lease with a signed ``revoke``; from anyone else (the
    holder's rival, the worker itself) it is refused and held, and the shard stays leased."""
    v = view()
    v.receive(lease(0, 1, W1), COORD.peer_id, NOW, ELIGIBLE)
    revoke = m.ShardRevoke(JOB, 1, 0, 1, W1.peer_id, 1, 16.0)
    assert v.receive(revoke, W2.peer_id, NOW + 16, ELIGIBLE).actions is None  # not the coordinator
    assert v.shard(0).phase is st.ShardPhase.LEASED and v.refused["coordinator"] == 1
    wrong = m.ShardRevoke(JOB, 1, 0, 1, W2.peer_id, 1, 16.0)  # names another worker than the holder
    assert v.receive(wrong, COORD.peer_id, NOW + 16, ELIGIBLE).actions is None
    assert v.shard(0).phase is st.ShardPhase.LEASED
    outcome = v.receive(revoke, COORD.peer_id, NOW + 17, ELIGIBLE, b"revoke")
    assert any(isinstance(a, st.ReopenShard) for a in outcome.actions) and outcome.evidence == (b"revoke",)
    assert (v.shard(0).phase, v.shard(0).excused) == (st.ShardPhase.OPEN, 1)
    assert v.revocations[(1, 0, 1)] == revoke
    assert v.receive(lease(0, 2, W2), COORD.peer_id, NOW + 18, ELIGIBLE).actions is not None
    assert (v.shard(0).worker, v.shard(0).attempt) == (W2.peer_id, 2)
