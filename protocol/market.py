"""The market's rules: what a job may spend, who may be leased and in which order, what a worker is owed.

Rules of this file (pure: no I/O, no clock; the document is ipips/0004-job-shard-lifecycle.md §12,
the vectors ``ipips/vectors/market-*.json``):

- **Paid work.** A job pays when its ``price_per_hour`` is above 0. A shard attempt's *hours* are the
  ``train_seconds`` its signed report states (``ShardReport.metrics``) / 3600; its cost is hours x the
  job's ``price_per_hour``. Only *accepted* attempts cost anything: rejected, expired and released
  work is not paid. A volunteer job (price 0) costs nothing and has no budget rule.
- **Budget.** A paid job's ``budget`` (the spec's ``budget.total``) caps what its work may cost.
  Its *committed* cost is what its accepted attempts cost plus what its reported attempts still
  awaiting a verdict would cost if accepted (their reports state their hours). Once the committed
  cost reaches the budget, no further lease is granted (``lease_refusal`` says why); a rejection
  that lowers it lets leasing go on. Work already leased may still be accepted and is paid: the
  budget stops new leases, it does not take back granted ones. A paid job with budget 0 can pay nobody.
- **Workers' side.** A worker refuses a job that pays less per hour than the worker asks (its
  capability's ``price_per_hour``), and a paid job whose budget is already spent (``worker_refusal``).
- **Whom to lease.** ``providers`` (when not empty) names the only peers a job may lease to;
  ``max_nodes`` (when above 0) caps how many distinct workers the job ever leases to: a worker already
  leased in the job may be leased again, a new one not once the cap is reached.
- **Order of grants.** Claims that reach the coordinator within one claim window are granted in
  order of the claimants' reputation score, best first; equal scores keep the claims' arrival order.
  A reputation counts, per worker across every job this agent has seen, its accepted and rejected
  verdicts and its *expired* attempts (leases that ended with no report: expired or given back);
  its score is ``(accepted + 1) / (accepted + rejected + expired + 2)`` (0.5 for a stranger).
- **Bills.** A bill lists, per worker, its accepted attempts, their hours, the price and the amount
  (hours x price), rejected attempts at amount 0, and the total; its canonical msgpack is signed by
  the submitter with the domain ``infernet/bill/v1`` 0x00 (as the ledger's entries, IPIP-0008).
  It is checked against the job's ledger chains (``compare_bill_with_ledger``, IPIP-0008 §2): only
  the verdict entries of the peer whose Verdict was applied for an attempt count.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from protocol.codec import canonical_encode
from protocol.schedule import round_steps

BILL_DOMAIN = b"infernet/bill/v1\x00"
SECONDS_PER_HOUR = 3600.0

Key = tuple[int, int, int]  # (round, shard, attempt): protocol/messages.ShardAttempt


def is_paid(price_per_hour: float) -> bool:
    return price_per_hour > 0.0


def attempt_hours(train_seconds: float) -> float:
    """Hours of one attempt from its report's ``train_seconds`` (negative or non-finite: 0)."""
    if not isinstance(train_seconds, (int, float)) or not math.isfinite(train_seconds) or train_seconds < 0:
        return 0.0
    return float(train_seconds) / SECONDS_PER_HOUR


def accepted_cost(price_per_hour: float, accepted_seconds: Iterable[float]) -> float:
    """What the accepted attempts cost at the job's price."""
    return sum(attempt_hours(s) for s in accepted_seconds) * price_per_hour


def budget_refusal(price_per_hour: float, budget: float, spent: float) -> str | None:
    """Why a paid job grants no more leases (its committed cost ``spent`` reached its budget), or None."""
    if not is_paid(price_per_hour) or spent < budget:
        return None
    if budget <= 0:
        return f"budget.total is 0: a job paying {price_per_hour:g}/h can pay for no work; no leases"
    return (f"budget spent: accepted and reported work costs {spent:.4f} of budget.total {budget:.4f} "
            f"at {price_per_hour:g}/h; no further leases")


def lease_refusal(worker: str, *, price_per_hour: float, budget: float, spent: float, max_nodes: int,
                  providers: Sequence[str], leased_workers: Iterable[str]) -> str | None:
    """Why ``worker`` may not get a lease of this job now, or None (the market's part of the rules;
    protocol/state.py and the coordinator's own rules come on top)."""
    reason = budget_refusal(price_per_hour, budget, spent)
    if reason is not None:
        return reason
    if providers and worker not in providers:
        return f"{worker} is not one of the job's {len(providers)} named providers"
    leased = set(leased_workers)
    if max_nodes > 0 and worker not in leased and len(leased) >= max_nodes:
        return f"max_nodes: the job already leased to {len(leased)} distinct workers (cap {max_nodes})"
    return None


def worker_refusal(*, price_per_hour: float, budget: float, spent: float, ask: float) -> str | None:
    """Why a worker asking ``ask`` per hour will not train for this job, or None."""
    if price_per_hour < ask:
        return f"the job pays {price_per_hour:g}/h, below this worker's price {ask:g}/h"
    if is_paid(price_per_hour) and spent >= budget:
        return (f"the job's budget cannot pay us: {spent:.4f} of budget.total {budget:.4f} already spent"
                if budget > 0 else "the job's budget.total is 0: it cannot pay for any work")
    return None


# -- reputation -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reputation:
    accepted: int = 0
    rejected: int = 0
    expired: int = 0

    @property
    def score(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + self.expired + 2)

    def __add__(self, other: "Reputation") -> "Reputation":
        return Reputation(self.accepted + other.accepted, self.rejected + other.rejected, self.expired + other.expired)

    def to_json(self) -> dict:
        return {"accepted": self.accepted, "rejected": self.rejected, "expired": self.expired,
                "score": round(self.score, 4)}


def job_outcomes(leases: Mapping[Key, str], reported: Iterable[Key], verdicts: Mapping[Key, tuple[str, bool]],
                 current: Mapping[tuple[int, int], int]) -> dict[str, Reputation]:
    """One job's contribution to reputations: verdicts by the worker they judge; an attempt that was
    leased, never reported, and is no longer its shard's current attempt (``current``: (round, shard)
    -> attempt now; a past round counts as settled) is an expired one of its lease holder."""
    out: dict[str, Reputation] = {}
    for (worker, accepted) in verdicts.values():
        out[worker] = out.get(worker, Reputation()) + Reputation(int(accepted), int(not accepted), 0)
    reported = set(reported)
    for key, worker in leases.items():
        rnd, shard, attempt = key
        if key in reported:
            continue
        if current.get((rnd, shard), attempt + 1) == attempt:
            continue  # still the live attempt: it may yet report
        out[worker] = out.get(worker, Reputation()) + Reputation(0, 0, 1)
    return out


def merge_reputations(parts: Iterable[Mapping[str, Reputation]]) -> dict[str, Reputation]:
    total: dict[str, Reputation] = {}
    for part in parts:
        for worker, rep in part.items():
            total[worker] = total.get(worker, Reputation()) + rep
    return total


def order_claims(claims: Sequence[tuple[str, int]], reputations: Mapping[str, Reputation]) -> list[tuple[str, int]]:
    """Claims ``(worker, shard)`` in the order leases are granted: best score first, arrival order on ties."""
    indexed = list(enumerate(claims))
    indexed.sort(key=lambda item: (-reputations.get(item[1][0], Reputation()).score, item[0]))
    return [claim for _, claim in indexed]


# -- estimates --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    tokens: int  # tokens in the training shards (the dataset less its validation split), per pass
    steps: int  # optimizer steps across every shard and round
    tokens_trained: int  # tokens processed across every shard and round
    tokens_per_s: float | None  # the advertised speed used (median of the providers'), None if none
    providers: int  # providers that advertise a speed for the model
    worker_hours: float | None
    wall_hours: float | None  # with min(providers, shards, max_nodes) workers at once
    price_per_hour: float
    cost: float | None
    budget: float

    @property
    def over_budget(self) -> bool:
        return self.cost is not None and is_paid(self.price_per_hour) and self.cost > self.budget

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["over_budget"] = self.over_budget
        return out


def median(values: Sequence[float]) -> float | None:
    values = sorted(v for v in values if v > 0 and math.isfinite(v))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def estimate(*, shard_tokens: Sequence[int], shard_steps: Sequence[int], tokens_per_step: Sequence[float],
             rounds: int, speeds: Sequence[float], price_per_hour: float, budget: float,
             max_nodes: int = 0, first_round_steps: Sequence[int] = ()) -> Estimate:
    """Expected worker-hours and cost of a job: each shard trains ``shard_steps`` steps of
    ``tokens_per_step`` tokens each round, at the median advertised speed; the job's first rounds
    train ``first_round_steps`` instead (``training.first_round_steps``; a job that names them sets
    ``max_steps``, so every shard's steps a round are the same)."""
    # each shard's steps over the job, round by round (protocol/schedule.round_steps)
    per_job = [sum(round_steps(s, tuple(first_round_steps), r) for r in range(1, rounds + 1)) for s in shard_steps]
    steps = sum(per_job)
    trained = int(round(sum(s * t for s, t in zip(per_job, tokens_per_step))))
    speed = median(speeds)
    hours = None if speed is None else trained / speed / SECONDS_PER_HOUR
    workers = min(len([s for s in speeds if s > 0]), len(shard_steps), max_nodes or len(shard_steps))
    wall = None
    if speed is not None and workers:
        per_shard = [s * t / speed / SECONDS_PER_HOUR for s, t in zip(per_job, tokens_per_step)]
        wall = max(per_shard) * math.ceil(len(per_shard) / workers)
    cost = None if hours is None else hours * price_per_hour
    return Estimate(sum(shard_tokens), steps, trained, speed, len([s for s in speeds if s > 0]), hours, wall,
                    price_per_hour, cost, budget)


# -- bills ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Attempt:
    """One reported attempt of a job and its verdict, as the signed messages state them."""

    worker: str
    round: int
    shard: int
    attempt: int
    train_seconds: float
    accepted: bool


def make_bill(job_id: bytes, submitter: str, price_per_hour: float, budget: float, attempts: Sequence[Attempt],
              issued: float) -> dict:
    """The bill of a job (a plain map; ``bill_bytes`` is what is signed): per worker, accepted
    attempts, hours, price and amount; rejected attempts listed at amount 0."""
    workers: dict[str, dict] = {}
    for a in sorted(attempts, key=lambda a: (a.worker, a.round, a.shard, a.attempt)):
        row = workers.setdefault(a.worker, {"worker": a.worker, "accepted": 0, "rejected": 0, "hours": 0.0,
                                            "price_per_hour": float(price_per_hour), "amount": 0.0, "attempts": []})
        hours = attempt_hours(a.train_seconds) if a.accepted else 0.0
        row["accepted" if a.accepted else "rejected"] += 1
        row["hours"] += hours
        row["attempts"].append({"round": a.round, "shard": a.shard, "attempt": a.attempt, "accepted": a.accepted,
                                "hours": hours, "amount": hours * price_per_hour})
    for row in workers.values():
        row["amount"] = row["hours"] * price_per_hour
    total = sum(row["amount"] for row in workers.values())
    return {"job_id": job_id, "submitter": submitter, "price_per_hour": float(price_per_hour),
            "budget": float(budget), "issued": float(issued), "workers": [workers[w] for w in sorted(workers)],
            "hours": sum(row["hours"] for row in workers.values()), "total": total}


def bill_bytes(bill: dict) -> bytes:
    return BILL_DOMAIN + canonical_encode(bill)


def bill_hash(bill: dict) -> bytes:
    return hashlib.sha256(bill_bytes(bill)).digest()


def compare_bill_with_ledger(doc: dict, entries: list, judges: dict[tuple, str]) -> dict:
    """Check each billed attempt against the ledger's signed entries (IPIP-0008 §2). ``judges`` maps
    (round, shard, attempt) to the signer of the Verdict our mirror applied for it (agent/market.verdict_signers):

    - a ``verdict`` entry for it written by that signer names the same worker and outcome, and every
      such entry agrees;
    - an accepted attempt has the worker's own ``report`` entry (signed by the worker it names), and
      its hours are that entry's ``duration`` / 3600, its amount those hours x the bill's price;
      a rejected one is billed 0;
    - every verdict entry in the ledger written by its attempt's judge is billed.

    A billed attempt the ledger lacks (no verdict, or no report) or contradicts is a problem. A verdict
    entry by anyone else (another participant, a coordinator whose verdict our mirror did not apply,
    one for an attempt our mirror holds no verdict of) is not evidence of this bill: listed in
    ``ignored``, never a problem. ``entries_checked``: the billed attempts whose verdict entries were
    found and compared."""
    reports: dict[tuple, list] = {}
    verdicts: dict[tuple, list] = {}
    ignored = []
    for e in entries:
        data = e.data
        key = (data.get("round"), data.get("shard"), data.get("attempt"))
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in key):
            continue  # an entry of another peer's chain that names no attempt: evidence of nothing billed
        if e.kind == "report" and data.get("worker") == e.signer_peer_id:
            reports.setdefault(key, []).append(data)
        elif e.kind == "verdict":
            judge = judges.get(key)
            if judge is not None and e.signer_peer_id == judge and data.get("worker") != judge:
                verdicts.setdefault(key, []).append(data)
            else:
                ignored.append(f"round {key[0]} shard {key[1]} attempt {key[2]}: a verdict entry by "
                               f"{e.signer_peer_id[-8:]}, " + (f"not by {judge[-8:]} whose verdict our mirror "
                                                               "applied" if judge else "no verdict in our mirror")
                               + ": not counted")
    price = doc["price_per_hour"]
    problems, checked, billed = [], 0, set()
    for row in doc["workers"]:
        worker = row["worker"]
        for item in row["attempts"]:
            key = (item["round"], item["shard"], item["attempt"])
            where = f"round {key[0]} shard {key[1]} attempt {key[2]} ({worker[-8:]})"
            billed.add(key)
            judged = verdicts.get(key)
            if not judged:
                problems.append(f"{where}: billed, but no verdict entry for it in the ledger chains held")
                continue
            checked += 1
            outcomes = {(v.get("worker"), v.get("accepted")) for v in judged}
            if outcomes != {(worker, item["accepted"])}:
                said = ", ".join(f"{'accepted' if a else 'rejected'} for {str(w)[-8:]}" for w, a in sorted(
                    outcomes, key=str))
                problems.append(f"{where}: billed {'accepted' if item['accepted'] else 'rejected'}, "
                                f"the ledger's verdict says {said}")
                continue
            if not item["accepted"]:
                if item["hours"] != 0 or item["amount"] != 0:
                    problems.append(f"{where}: a rejected attempt billed {item['hours']:.6f} h")
                continue
            stated = reports.get(key)
            if not stated or any(r.get("worker") != worker for r in stated):
                problems.append(f"{where}: billed, but the ledger holds no report entry of it by its worker")
                continue
            hours = {attempt_hours(r.get("duration", 0.0)) for r in stated}
            if len(hours) != 1 or abs(next(iter(hours)) - item["hours"]) > 1e-9:
                problems.append(f"{where}: billed {item['hours']:.6f} h, the ledger's report says "
                                + " or ".join(f"{h:.6f} h" for h in sorted(hours)))
            elif abs(item["hours"] * price - item["amount"]) > 1e-9 * max(1.0, abs(item["amount"])):
                problems.append(f"{where}: billed {item['amount']:.6f}, not its hours x {price:g}/h")
    for key in sorted(verdicts.keys() - billed, key=str):
        problems.append(f"round {key[0]} shard {key[1]} attempt {key[2]}: its judge's verdict in the ledger, "
                        "not billed")
    return {"entries_checked": checked, "consistent": not problems, "problems": problems, "ignored": ignored}
