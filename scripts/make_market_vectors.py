"""Write ipips/vectors/market-rules.json: the market's rules (protocol/market.py, IPIP-0004 §12) on fixed inputs.

Run it only when those rules change on purpose; tests/protocol/test_market.py checks that the code
still gives every committed answer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol import market as mk  # noqa: E402
from protocol.identity import Identity  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "ipips" / "vectors" / "market-rules.json"
A, B, C = (Identity(bytes([i]) * 32).peer_id for i in (21, 22, 23))


def lease_cases() -> list[dict]:
    base = {"price_per_hour": 2.0, "budget": 1.0, "spent": 0.5, "max_nodes": 0, "providers": [], "leased_workers": []}
    cases = [
        ("paid, budget left", {}),
        ("paid, budget reached", {"spent": 1.0}),
        ("paid, budget 0", {"budget": 0.0, "spent": 0.0}),
        ("volunteer ignores the budget", {"price_per_hour": 0.0, "budget": 0.0, "spent": 0.0}),
        ("not a named provider", {"providers": [B, C]}),
        ("a named provider", {"providers": [A, B]}),
        ("max_nodes reached by others", {"max_nodes": 2, "leased_workers": [B, C]}),
        ("max_nodes: a worker already leased", {"max_nodes": 2, "leased_workers": [A, B]}),
        ("max_nodes not reached", {"max_nodes": 3, "leased_workers": [B, C]}),
    ]
    out = []
    for name, change in cases:
        args = {**base, **change}
        reason = mk.lease_refusal(A, **args)
        out.append({"name": name, "worker": A, **args, "refusal": reason})
    return out


def worker_cases() -> list[dict]:
    cases = [("pays our price", 1.0, 10.0, 0.0, 1.0), ("pays less than we ask", 0.5, 10.0, 0.0, 1.0),
             ("budget spent", 1.0, 10.0, 10.0, 0.0), ("paid with budget 0", 1.0, 0.0, 0.0, 0.0),
             ("volunteer job, volunteer worker", 0.0, 0.0, 0.0, 0.0)]
    return [{"name": n, "price_per_hour": p, "budget": b, "spent": s, "ask": a,
             "refusal": mk.worker_refusal(price_per_hour=p, budget=b, spent=s, ask=a)} for n, p, b, s, a in cases]


def order_cases() -> list[dict]:
    reps = {A: mk.Reputation(0, 1, 0), B: mk.Reputation(3, 0, 0), C: mk.Reputation(0, 0, 0)}
    claims = [(A, 0), (C, 1), (B, 2)]
    return [{"claims": claims, "reputations": {k: [v.accepted, v.rejected, v.expired] for k, v in reps.items()},
             "scores": {k: v.score for k, v in reps.items()}, "order": mk.order_claims(claims, reps)}]


def outcome_cases() -> list[dict]:
    leases = {(1, 0, 1): A, (1, 0, 2): B, (1, 1, 1): C, (1, 1, 2): A, (2, 0, 1): B}
    reported = [(1, 0, 2), (1, 1, 1), (1, 1, 2)]
    verdicts = {(1, 0, 2): (B, True), (1, 1, 1): (C, False), (1, 1, 2): (A, True)}
    current = {(2, 0): 1}
    out = mk.job_outcomes(leases, reported, verdicts, current)
    enc = lambda d: [[list(k), v] for k, v in sorted(d.items())]  # noqa: E731
    return [{"leases": enc(leases), "reported": [list(k) for k in reported],
             "verdicts": [[list(k), list(v)] for k, v in sorted(verdicts.items())],
             "current": [[list(k), v] for k, v in current.items()],
             "reputations": {w: [r.accepted, r.rejected, r.expired] for w, r in sorted(out.items())}}]


def bill_cases() -> list[dict]:
    attempts = [mk.Attempt(A, 1, 0, 1, 1800.0, True), mk.Attempt(B, 1, 1, 1, 900.0, False),
                mk.Attempt(B, 1, 1, 2, 720.0, True), mk.Attempt(A, 2, 0, 1, 3600.0, True)]
    job_id = bytes(range(32))
    bill = mk.make_bill(job_id, C, 2.0, 10.0, attempts, 1_790_000_000.0)
    return [{"job_id_hex": job_id.hex(), "submitter": C, "price_per_hour": 2.0, "budget": 10.0,
             "issued": 1_790_000_000.0,
             "attempts": [[a.worker, a.round, a.shard, a.attempt, a.train_seconds, a.accepted] for a in attempts],
             "amounts": {row["worker"]: row["amount"] for row in bill["workers"]}, "total": bill["total"],
             "bill_sha256_hex": mk.bill_hash(bill).hex()}]


def estimate_cases() -> list[dict]:
    args = {"shard_tokens": [1000, 1200], "shard_steps": [10, 12], "tokens_per_step": [400.0, 420.0], "rounds": 3,
            "speeds": [500.0, 1500.0, 1000.0], "price_per_hour": 4.0, "budget": 0.05, "max_nodes": 0}
    ramped = {**args, "shard_steps": [100, 100], "rounds": 6, "first_round_steps": [25, 25, 50]}
    return [{**case, "result": mk.estimate(**case).to_json()} for case in (args, ramped)]


def main() -> None:
    doc = {"description": "protocol/market.py on fixed inputs (IPIP-0004 §12); peers are the peer IDs of seeds "
                          "21, 22, 23 repeated 32 times",
           "lease_refusal": lease_cases(), "worker_refusal": worker_cases(), "order_claims": order_cases(),
           "job_outcomes": outcome_cases(), "bills": bill_cases(), "estimates": estimate_cases()}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
