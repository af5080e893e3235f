"""Write ipips/vectors/early-start.json (IPIP-0006 §2.9, protocol/early.py: when a round may be announced early,
who is announced which shard, when a worker takes an announcement, where an early start stands; and IPIP-0003
§4.2: who fetches an announced start together, and how its parts are dealt, protocol/unixfs.deal); reviewed by
hand. Run from the repository root. Peer names stand for peer IDs."""
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from protocol import early  # noqa: E402
from protocol.messages import EarlyStart, Verdict  # noqa: E402
from protocol.state import JobConfig, JobPhase, JobState, ShardPhase, ShardState  # noqa: E402
from protocol.unixfs import deal  # noqa: E402

JOB = bytes(32)
CID, OTHER = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4", "bafkreiother"


def state_of(doc: dict) -> JobState:
    """A job state from its vector form: {"phase", "round", "shards": [[phase, attempt, worker], ...]}."""
    shards = tuple(ShardState(i, ShardPhase(p), a, w) for i, (p, a, w) in enumerate(doc["shards"]))
    return JobState(JobConfig(shards=len(shards), rounds=doc.get("rounds", 3)), shards, JobPhase(doc["phase"]),
                    doc["round"])


def job(phase: str, rnd: int, *shards: tuple) -> dict:
    return {"phase": phase, "round": rnd, "shards": [list(s) for s in shards]}


VERIFYING = job("VERIFYING", 1, ("REPORTED", 1, "A"), ("ACCEPTED", 1, "B"))
READY = [
    ("every shard reported or accepted, round 1 of 3", VERIFYING, 3),
    ("the last round is not announced", job("VERIFYING", 3, ("REPORTED", 1, "A")), 3),
    ("a shard still leased", job("TRAINING", 1, ("LEASED", 1, "A"), ("REPORTED", 1, "B")), 3),
    ("a shard failed this round", job("AGGREGATING", 1, ("FAILED", 3, None), ("ACCEPTED", 1, "B")), 3),
    ("a finished job", job("DONE", 1, ("ACCEPTED", 1, "A")), 3),
]
ASSIGN = [
    ("each worker its shard", [(0, "A"), (1, "B"), (2, "D")], "C", []),
    ("a worker that trained two shards is announced its first", [(0, "A"), (1, "B"), (2, "A")], "C", []),
    ("never the coordinator", [(0, "C"), (1, "B")], "C", []),
    ("never a worker the job rejected", [(0, "A"), (1, "B")], "C", [("B", False)]),
    ("no worker named", [(0, None)], "C", []),
]
REFUSE = [
    ("from the coordinator, its term, the next round, verifying", "C", 1, 2, VERIFYING, (0,)),
    ("aggregating is as good", "C", 1, 2, job("AGGREGATING", 1, ("ACCEPTED", 1, "A")), (0,)),
    ("not signed by the coordinator", "X", 1, 2, VERIFYING, (0,)),
    ("an older term", "C", 0, 2, VERIFYING, (0,)),
    ("not the round after the mirror's", "C", 1, 3, VERIFYING, (0,)),
    ("while the round still trains", "C", 1, 2, job("TRAINING", 1, ("LEASED", 1, "A")), (0,)),
    ("past the job's last round", "C", 1, 2, job("VERIFYING", 1, ("REPORTED", 1, "A")) | {"rounds": 1}, (0,)),
    ("a shard the job does not have", "C", 1, 2, VERIFYING, (5,)),
]
STAND = [
    ("the round before still verified", VERIFYING, None, CID),
    ("the round before trains again (a shard reopened)", job("TRAINING", 1, ("OPEN", 1, None), ("ACCEPTED", 1, "B")),
     None, CID),
    ("the round began, the shard not leased yet", job("TRAINING", 2, ("OPEN", 0, None), ("OPEN", 0, None)), CID, CID),
    ("leased to us, attempt 1, from the aggregate announced", job("TRAINING", 2, ("LEASED", 1, "A"), ("OPEN", 0, None)),
     CID, CID),
    ("leased to another", job("TRAINING", 2, ("LEASED", 1, "B"), ("OPEN", 0, None)), CID, CID),
    ("another aggregate was published", job("TRAINING", 2, ("LEASED", 1, "A"), ("OPEN", 0, None)), OTHER, CID),
    ("the job is past that round", job("TRAINING", 3, ("OPEN", 0, None)), CID, CID),
    ("the job ended", job("FAILED", 2, ("OPEN", 0, None)), CID, CID),
]


# (name, round r's (shard, worker) pairs, the early message's (shard, worker) pairs, the worker, open shards of round
# r + 1 when it claims)
QUEUE = [
    ("two shards each: each its second after its first", [(0, "A"), (1, "B"), (2, "A"), (3, "B")],
     [(0, "A"), (1, "B")], "A", [2, 3]),
    ("the other worker's view of the same round", [(0, "A"), (1, "B"), (2, "A"), (3, "B")],
     [(0, "A"), (1, "B")], "B", [2, 3]),
    ("three shards, in index order", [(0, "A"), (3, "A"), (1, "A"), (2, "B")], [(0, "A"), (2, "B")], "A", [1, 3]),
    ("a worker the message does not name trains none early, claims the others' last", [(0, "A"), (1, "B"), (2, "A")],
     [(0, "A")], "B", [1, 2]),
    ("a newcomer claims what is not reserved", [(0, "A"), (1, "C"), (2, "A"), (3, None)], [(0, "A")], "D", [2, 3]),
    ("only reserved shards are open: any of them", [(0, "A"), (1, "B"), (2, "A"), (3, "B")], [(0, "A"), (1, "B")],
     "D", [2, 3]),
    ("the coordinator's shard (not announced) is free to all", [(0, "A"), (1, "C"), (2, "A")], [(0, "A")], "B",
     [1, 2]),
]

RECLAIM = [
    ("open a moment, under the coordinator that announced it", 0.5, 1, 1),
    ("open long enough: the claim was lost", 2.0, 1, 1),
    ("a coordinator elected since the announcement", 0.0, 1, 2),
    ("open long enough, but the worker holds a live lease of the job (a queued start)", 5.0, 1, 1, True),
    ("a new coordinator, but the worker holds a live lease of the job", 0.0, 1, 2, True),
]


SWARM = [
    ("the announced workers in its order, then the submitter", ("B", "A"), "S"),
    ("a submitter that is also announced is named once", ("A", "S"), "S"),
]
DEAL = [
    ("five parts, three members", 5, ["B", "A", "S"]),
    ("fewer parts than members", 2, ["A", "B", "S"]),
    ("one member takes all", 3, ["A"]),
]


def verdict(worker: str, accepted: bool) -> Verdict:
    return Verdict(JOB, 1, 0, 1, worker, 1, accepted, "ok" if accepted else "segment 1 does not replay", ())


def main() -> None:
    ready = [{"name": n, "state": s, "rounds": r, "ready": early.ready(state_of(s), r)} for n, s, r in READY]
    assignment = [{"name": n, "trained": t, "coordinator": c, "verdicts": [{"worker": w, "accepted": a} for w, a in v],
                   "announced": [list(x) for x in early.assignment(t, c, [verdict(w, a) for w, a in v])]}
                  for n, t, c, v in ASSIGN]
    refusal = []
    for n, signer, term, rnd, s, shards in REFUSE:
        msg = EarlyStart(JOB, rnd, term, CID, shards, tuple("A" for _ in shards))
        why = early.refusal(msg, signer, "C", 1, state_of(s), s.get("rounds", 3))
        refusal.append({"name": n, "signer": signer, "coordinator": "C", "coordination_term": 1, "early_round": rnd,
                        "early_term": term, "early_shards": list(shards), "state": s, "rounds": s.get("rounds", 3),
                        "taken": why is None, "reason": why})
    standing = []
    for n, s, published, start in STAND:
        out = early.standing(state_of(s), published, 2, 0, 1, "A", start)
        standing.append({"name": n, "state": s, "published": published, "round": 2, "shard": 0, "attempt": 1,
                         "worker": "A", "start": start,
                         "standing": out if out in (early.OURS, early.WAIT, early.OPEN) else "void", "reason": out})
    queue = []
    for n, trained, announced, worker, open_shards in QUEUE:
        msg = EarlyStart(JOB, 2, 1, CID, tuple(i for i, _ in announced), tuple(w for _, w in announced))
        reserved = early.reserved(trained, msg, worker)
        queue.append({"name": n, "trained": [list(x) for x in trained], "announced": [list(x) for x in announced],
                      "worker": worker, "queued": list(early.queued(trained, msg, worker)),
                      "reserved": sorted(reserved), "open": open_shards,
                      "claimable": early.claimable(open_shards, reserved)})
    reclaim = [{"name": n, "open_for": t, "early_term": e, "term": term, "holding": bool(holding),
                "reclaim": early.reclaim(t, e, term, bool(holding))}
               for n, t, e, term, *holding in RECLAIM]
    swarm = [{"name": n, "early_workers": list(w), "submitter": sub,
              "members": list(early.swarm(EarlyStart(JOB, 2, 1, CID, tuple(range(len(w))), w), sub))}
             for n, w, sub in SWARM]
    dealt = [{"name": n, "parts": k, "members": m, "dealt": deal(k, m)} for n, k, m in DEAL]
    doc = {
        "description": "IPIP-0006 §2.9 early start. 'ready': may round round + 1 be announced (every shard REPORTED "
                       "or ACCEPTED, not the last round). 'assignment': the (shard, worker) pairs announced from the "
                       "round's (shard, worker) pairs: each worker its first shard, not the coordinator, not a worker "
                       "a verdict rejected. 'refusal': does a worker take an announcement (from the coordinator in its "
                       "term, for the round after its mirror's, while it is VERIFYING or AGGREGATING). 'standing': "
                       "ours, wait, open (round began, not leased yet: the worker's timer) or void. 'reclaim': does a worker whose "
                       "early start has stood open for open_for seconds claim its shard again (once), given the "
                       "early message's term, the coordination term now, and whether it holds a live lease of the "
                       "job ('holding': then not). States are "
                       "{phase, round, shards: [[phase, attempt, worker]]}. 'ready', 'announced', 'taken', "
                       "'standing' and 'reclaim' are normative; 'reason' is not. 'queue': for a round r + 1 announced early with "
                       "(shard, worker) pairs 'announced', from round r's (shard, worker) pairs 'trained': the shards "
                       "'worker' trains early after its announced one, in this order ('queued': its other shards of "
                       "round r, none announced to another), the shards it claims only when no other is open "
                       "('reserved': announced to or queued by another announced worker), and the ones it picks a "
                       "claim from among the open shards 'open' ('claimable'); all three normative. 'swarm' (IPIP-0003 §4.2): the peers that fetch an "
                       "announced start together, in the order all of them use; 'deal': which of a root's parts "
                       "(subtrees, next first, by index) each member takes from the seed, and is asked for by the "
                       "others. 'members' and 'dealt' are normative.",
        "ready": ready, "assignment": assignment, "refusal": refusal, "standing": standing, "queue": queue,
        "reclaim": reclaim,
        "swarm": swarm, "deal": dealt,
    }
    Path("ipips/vectors/early-start.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
