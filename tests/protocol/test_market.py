"""The market's rules (protocol/market.py, IPIP-0004 §12): the committed vectors, and the rules by hand."""

from __future__ import annotations

import json
import math

import pytest

from protocol import market as mk
from protocol import messages as m
from protocol.errors import CodecError
from protocol.identity import Identity, verify_signature
from tests.conftest import IPIP_VECTORS

VECTORS = json.loads((IPIP_VECTORS / "market-rules.json").read_text())
A, B, C = (Identity(bytes([i]) * 32).peer_id for i in (21, 22, 23))


def _key(item):
    return tuple(item)


def test_lease_and_worker_refusals_match_the_vectors():
    for case in VECTORS["lease_refusal"]:
        args = {k: case[k] for k in ("price_per_hour", "budget", "spent", "max_nodes", "providers", "leased_workers")}
        assert mk.lease_refusal(case["worker"], **args) == case["refusal"], case["name"]
    for case in VECTORS["worker_refusal"]:
        got = mk.worker_refusal(price_per_hour=case["price_per_hour"], budget=case["budget"], spent=case["spent"],
                                ask=case["ask"])
        assert got == case["refusal"], case["name"]


def test_claims_are_granted_best_reputation_first_and_ties_keep_arrival_order():
    case = VECTORS["order_claims"][0]
    reps = {w: mk.Reputation(*v) for w, v in case["reputations"].items()}
    claims = [tuple(c) for c in case["claims"]]
    assert [list(c) for c in mk.order_claims(claims, reps)] == case["order"]
    # by hand: B (3 accepted, 0.8) before the stranger C (0.5) before A (1 rejected, 1/3)
    assert [w for w, _ in mk.order_claims(claims, reps)] == [B, C, A]
    assert mk.Reputation().score == 0.5 and mk.Reputation(3, 0, 0).score == 0.8
    # equal scores keep the order the claims arrived in, whoever they are
    assert mk.order_claims([(C, 0), (A, 1), (B, 2)], {}) == [(C, 0), (A, 1), (B, 2)]
    expired = {A: mk.Reputation(0, 0, 2), B: mk.Reputation(2, 0, 0)}
    assert mk.order_claims([(A, 0), (B, 0)], expired) == [(B, 0), (A, 0)]


def test_job_outcomes_count_verdicts_and_attempts_that_ended_without_a_report():
    case = VECTORS["job_outcomes"][0]
    leases = {_key(k): w for k, w in case["leases"]}
    verdicts = {_key(k): tuple(v) for k, v in case["verdicts"]}
    current = {_key(k): v for k, v in case["current"]}
    out = mk.job_outcomes(leases, [_key(k) for k in case["reported"]], verdicts, current)
    assert {w: [r.accepted, r.rejected, r.expired] for w, r in out.items()} == case["reputations"]
    # the live attempt of a shard is never counted as expired
    assert mk.job_outcomes({(1, 0, 1): A}, [], {}, {(1, 0): 1}) == {}
    assert mk.job_outcomes({(1, 0, 1): A}, [], {}, {(1, 0): 2}) == {A: mk.Reputation(0, 0, 1)}


def test_bill_pays_accepted_hours_at_the_job_price_and_rejected_work_nothing():
    case = VECTORS["bills"][0]
    attempts = [mk.Attempt(*a) for a in case["attempts"]]
    bill = mk.make_bill(bytes.fromhex(case["job_id_hex"]), case["submitter"], case["price_per_hour"], case["budget"],
                        attempts, case["issued"])
    assert {row["worker"]: row["amount"] for row in bill["workers"]} == case["amounts"]
    assert bill["total"] == case["total"] and mk.bill_hash(bill).hex() == case["bill_sha256_hex"]
    rows = {row["worker"]: row for row in bill["workers"]}
    assert math.isclose(rows[A]["amount"], (1800 + 3600) / 3600 * 2.0)  # two accepted attempts
    assert rows[B]["rejected"] == 1 and math.isclose(rows[B]["amount"], 720 / 3600 * 2.0)  # the rejected one is free
    # the bill is signed under its own domain: not valid as a ledger entry's or an envelope's signature
    who = Identity(bytes([23]) * 32)
    signature = who.sign(mk.bill_bytes(bill))
    assert verify_signature(who.public_key, mk.bill_bytes(bill), signature)
    assert not verify_signature(who.public_key, mk.bill_bytes(bill)[len(mk.BILL_DOMAIN):], signature)


def test_estimate_matches_the_vector_and_has_no_hours_without_a_measured_speed():
    case = VECTORS["estimates"][0]
    args = {k: v for k, v in case.items() if k != "result"}
    assert mk.estimate(**args).to_json() == case["result"]
    none = mk.estimate(**{**args, "speeds": []})
    assert none.worker_hours is None and none.cost is None and none.tokens_per_s is None
    over = mk.estimate(**{**args, "budget": 0.01})
    assert over.over_budget
    # a job whose first rounds train fewer steps (training.first_round_steps): 25 + 25 + 50 + 3 x 100 a shard
    ramped = VECTORS["estimates"][1]
    assert mk.estimate(**{k: v for k, v in ramped.items() if k != "result"}).to_json() == ramped["result"]
    assert ramped["result"]["steps"] == 2 * (25 + 25 + 50 + 3 * 100), ramped["result"]


def test_accepted_cost_reaches_the_budget_and_stops_leasing():
    spent = mk.accepted_cost(3.6, [500.0, 500.0])  # 1000 s at 3.6/h = 1.0
    assert math.isclose(spent, 1.0)
    assert mk.budget_refusal(3.6, 1.5, spent) is None
    assert "budget spent" in mk.budget_refusal(3.6, 1.0, spent)
    assert mk.attempt_hours(float("nan")) == 0.0 and mk.attempt_hours(-5.0) == 0.0


def test_terms_and_capability_extension_fields_round_trip_and_are_checked():
    from scripts.make_envelope_vectors import sample_capability, sample_terms
    from dataclasses import replace

    terms = sample_terms(Identity(bytes([1]) * 32))
    assert "max_nodes" not in terms.to_wire() and "providers" not in terms.to_wire()  # old IDs unchanged
    market = replace(terms, max_nodes=2, providers=(A, B))
    assert m.JobTerms.from_wire(market.to_wire()) == market and market.job_id() != terms.job_id()
    with pytest.raises(CodecError, match="providers"):
        m.JobTerms.from_wire({**market.to_wire(), "providers": [A, A]})
    with pytest.raises(CodecError, match="providers"):
        m.JobTerms.from_wire({**market.to_wire(), "providers": ["not-a-peer"]})
    with pytest.raises(CodecError, match="max_nodes: holds its default"):
        m.JobTerms.from_wire({**terms.to_wire(), "max_nodes": 0})
    cap = replace(sample_capability(), speeds=(m.ModelSpeed(bytes(range(32)), 1200.0, "cpu"),))
    assert m.Capability.from_wire(cap.to_wire()) == cap
    with pytest.raises(CodecError, match="tokens_per_s"):
        m.Capability.from_wire({**cap.to_wire(), "speeds": [{"sha256": bytes(32), "tokens_per_s": 0.0, "device": "cpu"}]})
    with pytest.raises(CodecError, match="listed twice"):
        m.Capability.from_wire({**cap.to_wire(), "speeds": cap.to_wire()["speeds"] * 2})
