"""Coordinator election: the score's exact bytes, the IPIP vectors, rendezvous properties (agreement,
minimal movement), and the term rules."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.election import (
    ELECTION_DOMAIN,
    Coordination,
    elect,
    election_score,
    live_peers,
    rank_peers,
    stepped_down,
)
from protocol.errors import StateError
from protocol.identity import Identity, peer_id_bytes

VECTORS = Path(__file__).resolve().parents[2] / "ipips" / "vectors"
IDENTITIES = [Identity(bytes([i]) * 32) for i in range(1, 13)]
PEERS = [identity.peer_id for identity in IDENTITIES]
JOB = hashlib.sha256(b"a job").digest()

peer_sets = st.sets(st.sampled_from(PEERS), min_size=1)
job_ids = st.binary(min_size=32, max_size=32)


def test_score_is_sha256_of_domain_job_and_binary_peer_id_big_endian():
    identity = IDENTITIES[0]
    digest = hashlib.sha256(b"infernet/election/v1\x00" + JOB + peer_id_bytes(identity.public_key)).digest()
    assert ELECTION_DOMAIN == b"infernet/election/v1\x00"
    assert election_score(JOB, identity.peer_id) == int.from_bytes(digest, "big")


def test_ranking_is_by_score_highest_first():
    ranking = rank_peers(JOB, PEERS)
    scores = [election_score(JOB, p) for p in ranking]
    assert scores == sorted(scores, reverse=True)
    assert sorted(ranking) == sorted(PEERS)
    assert elect(JOB, PEERS) == ranking[0]


def test_no_live_peer_means_no_coordinator():
    assert elect(JOB, []) is None
    assert Coordination(JOB).follow_view([]) == Coordination(JOB)


@pytest.mark.parametrize("job_id", [b"short", b"x" * 33, "a" * 32, None])
def test_malformed_job_ids_raise_state_error(job_id):
    with pytest.raises(StateError, match="job ID must be 32 bytes"):
        elect(job_id, PEERS)


@pytest.mark.parametrize("peer", ["", "not a peer id", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", 7, None])
def test_malformed_peer_ids_raise_state_error(peer):
    with pytest.raises(StateError):
        rank_peers(JOB, [PEERS[0], peer])


# -- vectors -----------------------------------------------------------------------------------


def test_election_ranking_vectors():
    vector = json.loads((VECTORS / "election-ranking.json").read_text())
    assert bytes.fromhex(vector["domain_hex"]) == ELECTION_DOMAIN
    peers = []
    for entry in vector["peers"]:
        identity = Identity(bytes.fromhex(entry["seed_hex"]))
        assert identity.peer_id == entry["peer_id"]
        assert peer_id_bytes(identity.public_key).hex() == entry["peer_id_bytes_hex"]
        peers.append(identity.peer_id)
    assert len(vector["jobs"]) >= 3
    for job in vector["jobs"]:
        job_id = bytes.fromhex(job["job_id_hex"])
        for peer, score_hex in job["scores_hex"].items():
            assert election_score(job_id, peer) == int(score_hex, 16), (job["job_id_hex"], peer)
        assert list(rank_peers(job_id, peers)) == job["ranking"]
        assert elect(job_id, peers) == job["coordinator"]
        assert elect(job_id, set(peers) - {job["coordinator"]}) == job["without_first"]


def test_election_terms_vector():
    vector = json.loads((VECTORS / "election-terms.json").read_text())
    job_id = bytes.fromhex(vector["job_id_hex"])
    view = Coordination(job_id)
    for number, item in enumerate(vector["steps"], start=1):
        before = view
        if item["kind"] == "view":
            view = view.follow_view(item["live"])
        elif item.get("error"):
            with pytest.raises(StateError):
                view.check_message(item["signer"], item["term"], item["live"])
        else:
            view = view.check_message(item["signer"], item["term"], item["live"])
        assert (view.term, view.coordinator) == (item["expect_term"], item["expect_coordinator"]), number
        assert view.term >= before.term


# -- rendezvous properties -----------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(job_id=job_ids, live=peer_sets, seed=st.randoms(use_true_random=False))
def test_peers_with_the_same_live_view_agree(job_id, live, seed):
    """Whatever order each peer learnt its view in, they elect the same coordinator and ranking."""
    shuffled = list(live)
    seed.shuffle(shuffled)
    assert rank_peers(job_id, shuffled) == rank_peers(job_id, sorted(live))
    assert elect(job_id, shuffled + shuffled[:1]) == elect(job_id, frozenset(live))


@settings(max_examples=60, deadline=None)
@given(jobs=st.lists(job_ids, min_size=1, max_size=30, unique=True), live=peer_sets.filter(lambda s: len(s) >= 2))
def test_removing_the_coordinator_moves_only_its_jobs(jobs, live):
    before = {job: rank_peers(job, live) for job in jobs}
    removed = before[jobs[0]][0]
    for job, ranking in before.items():
        after = elect(job, live - {removed})
        if ranking[0] == removed:
            assert after == ranking[1], "a job of the removed peer goes to its runner-up"
        else:
            assert after == ranking[0], "every other job keeps its coordinator"


@settings(max_examples=60, deadline=None)
@given(jobs=st.lists(job_ids, min_size=1, max_size=30, unique=True), live=peer_sets, newcomer=st.sampled_from(PEERS))
def test_adding_a_peer_moves_only_the_jobs_it_now_wins(jobs, live, newcomer):
    live = live - {newcomer}
    for job in jobs:
        before = elect(job, live)
        after = elect(job, live | {newcomer})
        assert after in (before, newcomer)
        if after == newcomer and before is not None:
            assert election_score(job, newcomer) > election_score(job, before)


def test_jobs_spread_evenly_over_peers():
    """Rendezvous hashing balances load: 3000 fixed jobs over 12 peers, each coordinates 250 +- 25%."""
    jobs = [hashlib.sha256(b"balance %d" % n).digest() for n in range(3000)]
    load = Counter(elect(job, PEERS) for job in jobs)
    assert set(load) == set(PEERS)
    assert all(187 <= count <= 313 for count in load.values()), load


# -- liveness ----------------------------------------------------------------------------------


def test_a_peer_silent_for_missed_heartbeats_is_no_longer_live():
    last = {PEERS[0]: 100.0, PEERS[1]: 71.0, PEERS[2]: 70.0}
    assert live_peers(last, now=100.0, heartbeat_seconds=10.0, missed_heartbeats=3) == {PEERS[0], PEERS[1]}


# -- terms -------------------------------------------------------------------------------------


def test_losing_the_coordinator_starts_the_next_term_with_the_runner_up():
    ranking = rank_peers(JOB, PEERS[:4])
    view = Coordination(JOB).follow_view(PEERS[:4])
    assert (view.term, view.coordinator) == (1, ranking[0])
    assert view.follow_view(PEERS[:4]) is view  # same winner, same term
    view = view.follow_view(set(PEERS[:4]) - {ranking[0]})
    assert (view.term, view.coordinator) == (2, ranking[1])


def test_stale_term_messages_are_rejected():
    live = PEERS[:4]
    ranking = rank_peers(JOB, live)
    view = Coordination(JOB).follow_view(live)  # term 1: the first-ranked peer
    view = view.follow_view(set(live) - {ranking[0]})  # term 2: it fell silent, the runner-up
    view = view.follow_view(live)  # term 3: it is back
    assert (view.term, view.coordinator) == (3, ranking[0])
    with pytest.raises(StateError, match="stale term 2"):
        view.check_message(ranking[1], 2, live)
    assert view.check_message(ranking[0], 3, live) is view


def test_only_the_terms_coordinator_may_speak_in_it():
    live = PEERS[:4]
    view = Coordination(JOB).follow_view(live)
    other = next(p for p in live if p != view.coordinator)
    with pytest.raises(StateError, match="term 1 belongs to"):
        view.check_message(other, 1, live)


def test_a_deposed_coordinator_steps_down_on_a_higher_term():
    live = PEERS[:4]
    me = Coordination(JOB).follow_view(live)
    successor = rank_peers(JOB, live)[1]
    after = me.check_message(successor, me.term + 1, live)
    assert after.coordinator == successor and after.term == me.term + 1
    assert stepped_down(me, after, me.coordinator)
    assert not stepped_down(me, after, successor)


def test_a_higher_term_from_a_peer_outside_the_view_is_ignored():
    view = Coordination(JOB).follow_view(PEERS[:4])
    with pytest.raises(StateError, match="not an eligible live peer"):
        view.check_message(PEERS[5], 7, PEERS[:4])


@pytest.mark.parametrize("term", [0, -1, True, "2", 1.0, None])
def test_malformed_terms_are_rejected(term):
    with pytest.raises(StateError, match="term must be an integer"):
        Coordination(JOB).check_message(PEERS[0], term, PEERS)


@settings(max_examples=150, deadline=None)
@given(
    job_id=job_ids,
    moves=st.lists(
        st.one_of(
            st.tuples(st.just("view"), peer_sets),
            st.tuples(st.just("message"), st.sampled_from(PEERS), st.integers(0, 8), peer_sets),
        ),
        max_size=30,
    ),
)
def test_terms_never_decrease_and_stale_terms_never_pass(job_id, moves):
    view = Coordination(job_id)
    for move in moves:
        before = view
        if move[0] == "view":
            view = view.follow_view(move[1])
            assert view.coordinator == elect(job_id, move[1]), "a view change elects the view's winner"
            assert view.term == before.term + (view.coordinator != before.coordinator)
            continue
        _, signer, term, live = move
        try:
            view = view.check_message(signer, term, live)
        except StateError:
            continue
        assert term >= before.term, "a stale term never passes"
        assert view.term == term and view.coordinator == signer
        assert term == before.term or signer in live, "a higher term is adopted only from a live peer"


def test_keep_or_elect_keeps_a_live_coordinator_and_replaces_a_silent_one():
    from protocol.election import Coordination, keep_or_elect, rank_peers
    from protocol.identity import Identity

    job = bytes(range(32))
    peers = [Identity(bytes([i]) * 32).peer_id for i in range(1, 7)]
    ranking = rank_peers(job, peers)
    # first view over all but the top-ranked peer
    view = keep_or_elect(Coordination(job), ranking[1:])
    assert (view.term, view.coordinator) == (1, ranking[1])
    # the top-ranked peer appears: a running job does not move (follow_view would move it)
    assert keep_or_elect(view, ranking) == view
    assert Coordination(job).follow_view(ranking[1:]).follow_view(ranking).coordinator == ranking[0]
    # the coordinator falls silent: the best remaining peer takes over in the next term
    after = keep_or_elect(view, [p for p in ranking if p != ranking[1]])
    assert (after.term, after.coordinator) == (2, ranking[0])
    # nobody left: no coordinator, term still rises
    empty = keep_or_elect(after, [])
    assert (empty.term, empty.coordinator) == (3, None)


def test_election_submitter_side_vector():
    """IPIP-0006 §1.3 rule 5: only the submitter's side decides, and views change only once settled."""
    from protocol.election import hears_submitter

    vector = json.loads((VECTORS / "election-submitter.json").read_text())
    assert {c["expect"] for c in vector["cases"]} == {True, False}
    for case in vector["cases"]:
        got = hears_submitter(vector["submitter"], case["me"], case["last_heartbeat"], case["live_since"],
                              case["now"], settled=case["settled"], heartbeat_seconds=vector["heartbeat_seconds"],
                              missed_heartbeats=vector["missed_heartbeats"])
        assert got == case["expect"], case["name"]


def test_eligibility_vectors_read_the_capability():
    """ipips/vectors/election-eligibility.json: who may coordinate a job depends on its capability."""
    import json
    from dataclasses import replace

    from protocol import messages as m
    from protocol.election import eligible_for_job, rank_peers
    from protocol.identity import Identity
    from scripts.make_envelope_vectors import sample_capability, sample_terms

    doc = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/election-eligibility.json").read_text())
    base = sample_capability()
    caps = {}
    for peer, d in doc["peers"].items():
        devices = tuple(m.Device("cuda", i, "GPU", gb, gb, "8.0", True) for i, gb in enumerate(d["cuda_total_gb"]))
        models = tuple(m.ModelHeld(f"model-{h[:4]}", bytes.fromhex(h)) for h in d["models"])
        caps[peer] = replace(base, can_coordinate=d["can_coordinate"], devices=devices, models=models,
                             backends=tuple(d["backends"]))
    terms0 = sample_terms(Identity(bytes([1]) * 32))
    seen = set()
    for job in doc["jobs"]:
        terms = replace(terms0, base_model_sha256=bytes.fromhex(job["base_model_sha256"]), runtime=job["runtime"],
                        min_vram_gb=job["min_vram_gb"])
        assert terms.job_id().hex() == job["job_id_hex"]
        eligible = eligible_for_job(caps, caps, terms)
        assert sorted(eligible) == job["eligible"], job["name"]
        ranking = rank_peers(terms.job_id(), eligible)
        assert (ranking[0] if ranking else None) == job["coordinator"], job["name"]
        seen.add(len(eligible))
        # a peer not heard yet (no capability) is never eligible
        assert not eligible_for_job(caps, {p: None for p in caps}, terms)
    assert len(seen) >= 3  # the vectors exercise different outcomes, not one


def test_election_judge_vector():
    """IPIP-0006 §1.3 rule 6: a coordinator never judges its own work; the next eligible peer by rank does."""
    from protocol.election import judge_of, may_judge

    vector = json.loads((VECTORS / "election-judge.json").read_text())
    job = bytes.fromhex(vector["job_id_hex"])
    assert {c["expect"] for c in vector["accepts"]} == {True, False}
    for case in vector["judges"]:
        got = judge_of(job, case["coordinator"], case["worker"], case["eligible"])
        assert got == case["expect_judge"], case["name"]
        assert got != case["worker"] or case["coordinator"] != case["worker"]
    view = Coordination(job, vector["view"]["term"], vector["view"]["coordinator"])
    for case in vector["accepts"]:
        got = may_judge(view, case["signer"], case["worker"], case["term"], case["eligible"])
        assert got == case["expect"], case["name"]



def test_a_replayed_term_taken_from_a_verdict_is_settled_by_its_two_peers_vector():
    """IPIP-0006 §1.3 rule 6: in replayed history a term opened by a verdict may be its judge's."""
    from protocol.election import settle_replayed_term

    vector = json.loads((VECTORS / "election-judge.json").read_text())
    job = bytes.fromhex(vector["job_id_hex"])
    assert {c["expect"] for c in vector["replayed"]} >= {None, vector["ranking"][0], vector["ranking"][1]}
    for case in vector["replayed"]:
        got = settle_replayed_term(job, case["first"], case["judged"], case["signer"], case["worker"])
        assert got == case["expect"], case["name"]


def test_a_verdict_never_moves_a_view_to_a_higher_term_vector():
    """IPIP-0006 §1.3 rule 6: a verdict ahead of the view may be the judge's; it waits, a lease or aggregate moves the view."""
    vector = json.loads((VECTORS / "election-judge.json").read_text())
    job = bytes.fromhex(vector["job_id_hex"])
    five = [p for p in vector["ranking"]]
    start = Coordination(job, vector["ahead_view"]["term"], vector["ahead_view"]["coordinator"])
    assert {c["error"] for c in vector["ahead"]} == {True, False}
    for case in vector["ahead"]:
        try:
            after = start.check_message(case["signer"], case["term"], five, adopt=case["kind"] != "verdict")
            assert not case["error"], case["name"]
        except StateError:
            assert case["error"], case["name"]
            after = start
        assert (after.term, after.coordinator) == (case["expect_term"], case["expect_coordinator"]), case["name"]


def test_verdicts_of_earlier_terms_vector():
    """IPIP-0006 §1.3 rule 7 (issue #17): a verdict of an earlier term applies when its signer held that
    term in our view (or judged that coordinator's report), or our view skipped the term and the signer
    is eligible; never on an attempt leased after its term, never signed by its worker; never moves the view."""
    from protocol.election import may_apply_past_verdict

    vector = json.loads((VECTORS / "election-past.json").read_text())
    job = bytes.fromhex(vector["job_id_hex"])
    view = Coordination(job, vector["start"]["term"], vector["start"]["coordinator"])
    for move in vector["moves"]:
        view = view.check_message(move["signer"], move["term"], vector["ranking"])
    assert (view.term, view.coordinator) == (vector["view"]["term"], vector["view"]["coordinator"])
    assert [list(p) for p in view.past] == vector["past"]
    assert {c["expect"] for c in vector["cases"]} == {True, False}
    for case in vector["cases"]:
        got = may_apply_past_verdict(view, case["signer"], case["worker"], case["term"], case["lease_term"],
                                     case["eligible"])
        assert got == case["expect"], case["name"]


def test_decisions_of_earlier_terms_vouched_for_by_the_coordinators_history_vector():
    """IPIP-0006 §1.3 rule 9: in the history its view's coordinator serves, a submitter catching up takes a
    decision of an earlier term when that term's coordinator in its view signed it, or it skipped that term,
    whoever signed it (live or gone); a verdict keeps rule 7's checks and never judges the voucher's work."""
    from protocol.election import may_apply_vouched_past

    vector = json.loads((VECTORS / "election-past.json").read_text())
    view = Coordination(bytes.fromhex(vector["job_id_hex"]), vector["start"]["term"], vector["start"]["coordinator"])
    for move in vector["moves"]:
        view = view.check_message(move["signer"], move["term"], vector["ranking"])
    assert {c["expect"] for c in vector["vouched"]} == {True, False}
    for case in vector["vouched"]:
        worker = case["worker"] if case["kind"] == "verdict" else None
        got = may_apply_vouched_past(view, case["signer"], case["term"], worker, case["lease_term"])
        assert got == case["expect"], case["name"]


def test_a_view_remembers_a_bounded_number_of_earlier_terms():
    from protocol.election import PAST_TERMS_KEPT, may_apply_past_verdict

    vector = json.loads((VECTORS / "election-past.json").read_text())
    job, ranking = bytes.fromhex(vector["job_id_hex"]), vector["ranking"]
    view = Coordination(job)
    for term in range(1, PAST_TERMS_KEPT + 10):
        view = view.check_message(ranking[term % 2], term, ranking)
    assert len(view.past) == PAST_TERMS_KEPT and view.past[-1][0] == view.term - 1
    forgotten = view.past[0][0] - 1  # older than what it remembers: refused, not taken as skipped
    assert not may_apply_past_verdict(view, ranking[forgotten % 2], ranking[4], forgotten, None, ranking)
    assert may_apply_past_verdict(view, ranking[view.past[0][0] % 2], ranking[4], view.past[0][0], None, ranking)


def test_a_live_coordinator_that_does_not_claim_its_term_is_deposed_vector():
    """IPIP-0006 §1.3 rule 10: a view's coordinator, eligible and live, that has not claimed the view's term for
    the window since the view named it (or since its last claim) gives the next term to the first by rank of
    the other eligible live peers; it stays when it is the asking peer, not eligible, or alone."""
    from protocol.election import (HEARTBEAT_SECONDS, MISSED_HEARTBEATS, UNCLAIMED_FACTOR, depose_unclaimed)

    vector = json.loads((VECTORS / "election-unclaimed.json").read_text())
    job = bytes.fromhex(vector["job_id_hex"])
    assert {c["window"] for c in vector["cases"]} == {UNCLAIMED_FACTOR * MISSED_HEARTBEATS * HEARTBEAT_SECONDS}
    moved = 0
    for case in vector["cases"]:
        view = Coordination(job, case["view"]["term"], case["view"]["coordinator"])
        after = depose_unclaimed(view, case["eligible"], case["me"], case["named_at"], case["claimed_at"], case["now"],
                                 case["window"])
        assert (after.term, after.coordinator) == (case["expect"]["term"], case["expect"]["coordinator"]), case["name"]
        moved += after != view
        if after != view:
            assert after.past[-1] == (view.term, view.coordinator)  # the deposed term is remembered (rule 7)
    assert 0 < moved < len(vector["cases"])


def test_one_coordinator_counted_lower_by_its_own_view_vector():
    """IPIP-0006 §1.3 rule 11: a lower term than the view's passes only from the view's own coordinator, in the
    very term its latest heartbeat claims (its current tenure, numbered lower there), and never moves the view;
    its judge's verdict likewise."""
    from protocol.election import may_apply_past_verdict, may_judge

    vector = json.loads((VECTORS / "election-renumbered.json").read_text())
    job, ranking = bytes.fromhex(vector["job_id_hex"]), vector["ranking"]
    view = Coordination(job, 1, ranking[0])._moved(vector["view"]["term"], vector["view"]["coordinator"])
    assert [list(p) for p in view.past] == vector["view"]["past"]
    assert {c["applies"] for c in vector["messages"]} == {True, False}
    for case in vector["messages"]:
        try:
            after = view.check_message(case["signer"], case["term"], ranking, adopt=case["kind"] != "verdict",
                                       claimed=case["claimed"])
        except StateError:
            assert not case["applies"], case["name"]
            continue
        assert case["applies"], case["name"]
        assert (after.term, after.coordinator) == (case["expect_view"]["term"], case["expect_view"]["coordinator"])
    assert {c["applies"] for c in vector["judged"]} == {True, False}
    for case in vector["judged"]:
        got = may_judge(view, case["signer"], case["worker"], case["term"], ranking, case["claimed"])
        assert got == case["applies"], case["name"]
    assert {c["applies"] for c in vector["past_verdicts"]} == {True, False}
    for case in vector["past_verdicts"]:
        got = may_apply_past_verdict(view, case["signer"], case["worker"], case["term"], case["lease_term"], ranking,
                                     case["claimed"])
        assert got == case["applies"], case["name"]
