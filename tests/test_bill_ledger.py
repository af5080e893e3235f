"""IPIP-0008 §2: a bill against the ledger's signed chains. Only the verdict entries of the peer that
signed the Verdict our mirror applied for an attempt count (protocol/market.compare_bill_with_ledger):
another participant's entries, an old coordinator's after a failover, or an invented attempt's never
make an honest bill inconsistent; a contradiction by the judge itself still does."""

from __future__ import annotations

from protocol import market as mk
from protocol.identity import Identity
from protocol.ledger import ZERO_HASH, LedgerEntry

JOB = bytes.fromhex("961c31ceb871be7d3b864ec981e85428255a44e87de542a36c1942d5a33f0143")
SUBMITTER = Identity(bytes([11]) * 32)
JUDGE = Identity(bytes([12]) * 32)  # the coordinator whose verdicts our mirror applied
WORKER = Identity(bytes([13]) * 32)
OTHER = Identity(bytes([14]) * 32)  # another participant (or a coordinator that lost its term)
PRICE = 3600.0
ACCEPTED, REJECTED = (1, 0, 1), (1, 1, 1)


def chain(identity: Identity, kinds: list[tuple[str, dict]]) -> list[LedgerEntry]:
    out, prev = [], ZERO_HASH
    for seq, (kind, data) in enumerate(kinds):
        entry = LedgerEntry.create(identity, JOB, seq, prev, 1790000000.0 + seq, identity.peer_id, kind, data)
        out.append(entry)
        prev = entry.hash
    return out


def verdict(key: tuple, accepted: bool, worker: str = WORKER.peer_id) -> tuple[str, dict]:
    return "verdict", {"round": key[0], "shard": key[1], "attempt": key[2], "worker": worker,
                       "accepted": accepted, "reason": "checked" if accepted else "bad loss"}


def report(key: tuple, duration: float) -> tuple[str, dict]:
    return "report", {"round": key[0], "shard": key[1], "attempt": key[2], "worker": WORKER.peer_id,
                      "adapter_cid": "bafy", "duration": duration, "samples": 8, "hardware": "cpu",
                      "price_per_hour": PRICE}


def honest() -> tuple[dict, list[LedgerEntry], dict]:
    """A bill of one accepted and one rejected attempt, the chains that back it, and who judged them."""
    doc = mk.make_bill(JOB, SUBMITTER.peer_id, PRICE, 100.0, [
        mk.Attempt(WORKER.peer_id, *ACCEPTED, 36.0, True), mk.Attempt(WORKER.peer_id, *REJECTED, 20.0, False)],
        1790000100.0)
    entries = (chain(JUDGE, [verdict(ACCEPTED, True), verdict(REJECTED, False)])
               + chain(WORKER, [report(ACCEPTED, 36.0), report(REJECTED, 20.0)]))
    return doc, entries, {ACCEPTED: JUDGE.peer_id, REJECTED: JUDGE.peer_id}


def test_an_honest_bill_is_consistent():
    doc, entries, judges = honest()
    out = mk.compare_bill_with_ledger(doc, entries, judges)
    assert out["consistent"], out["problems"]
    assert out["entries_checked"] == 2 and out["ignored"] == []


def test_other_peers_verdict_entries_do_not_make_an_honest_bill_inconsistent():
    doc, entries, judges = honest()
    invented = (1, 5, 3)  # an attempt that never existed
    others = chain(OTHER, [verdict(ACCEPTED, False), verdict(REJECTED, True, worker=OTHER.peer_id),
                           verdict(invented, True),
                           ("verdict", {"round": [1], "shard": 0, "attempt": 1, "worker": WORKER.peer_id,
                                        "accepted": True, "reason": "names no attempt"})])
    out = mk.compare_bill_with_ledger(doc, entries + others, judges)
    assert out["consistent"], out["problems"]
    assert out["entries_checked"] == 2
    assert len(out["ignored"]) == 3 and all(OTHER.peer_id[-8:] in line for line in out["ignored"])
    assert any("round 1 shard 5 attempt 3" in line and "no verdict in our mirror" in line for line in out["ignored"])
    assert any("round 1 shard 0 attempt 1" in line and f"not by {JUDGE.peer_id[-8:]}" in line
               for line in out["ignored"])
    # the judge's own entry for an attempt our mirror judged with someone else's verdict is not counted either
    out = mk.compare_bill_with_ledger(doc, entries, {ACCEPTED: JUDGE.peer_id, REJECTED: OTHER.peer_id})
    assert not out["consistent"]
    assert any("round 1 shard 1 attempt 1" in p and "no verdict entry" in p for p in out["problems"]), out


def test_the_judges_own_entries_are_still_checked():
    doc, entries, judges = honest()
    # the judge's chain also says the accepted attempt was rejected
    contradicted = chain(JUDGE, [verdict(ACCEPTED, True), verdict(REJECTED, False), verdict(ACCEPTED, False)])
    out = mk.compare_bill_with_ledger(doc, contradicted + entries[2:], judges)
    assert not out["consistent"]
    assert any("round 1 shard 0 attempt 1" in p and "rejected for" in p for p in out["problems"]), out["problems"]
    # a verdict of the judge's that the bill leaves out
    left_out = (2, 0, 1)
    extra = chain(JUDGE, [verdict(ACCEPTED, True), verdict(REJECTED, False), verdict(left_out, True)])
    out = mk.compare_bill_with_ledger(doc, extra + entries[2:], {**judges, left_out: JUDGE.peer_id})
    assert not out["consistent"]
    assert any("round 2 shard 0 attempt 1" in p and "not billed" in p for p in out["problems"]), out["problems"]
    # no entry by the judge at all: the billed attempts are unbacked, whatever the others wrote
    others = chain(OTHER, [verdict(ACCEPTED, True), verdict(REJECTED, False)])
    out = mk.compare_bill_with_ledger(doc, others + entries[2:], judges)
    assert not out["consistent"] and out["entries_checked"] == 0
    assert sum("no verdict entry" in p for p in out["problems"]) == 2
