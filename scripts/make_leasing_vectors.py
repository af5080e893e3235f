"""Write ipips/vectors/lease-history.json (IPIP-0004 §5.1 rule 0: who the job's signed history forbids a
lease to); reviewed by hand. Run from the repository root."""
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from protocol.leasing import history_refusal  # noqa: E402
from protocol.state import ShardPhase, ShardState  # noqa: E402

JOB = bytes(32)


def verdict(worker: str, accepted: bool, rnd: int = 1, shard: int = 0, attempt: int = 1, term: int = 1) -> dict:
    return {"worker": worker, "accepted": accepted, "round": rnd, "shard": shard, "attempt": attempt, "term": term,
            "reason": "ok" if accepted else "segment 2 does not replay"}


def shard(index: int, phase: str, worker: str | None = None) -> dict:
    return {"index": index, "phase": phase, "worker": worker}


CASES = [
    ("a new claimant, nothing against it", "W", "C", [], [shard(0, "OPEN")]),
    ("the coordinator itself, with no other peer to judge its report", "C", "C", [], [shard(0, "OPEN")]),
    ("the coordinator itself, its report judged by J", "C", "C", [], [shard(0, "OPEN")], "J"),
    ("the coordinator itself, judged by J, already holding a live lease", "C", "C", [],
     [shard(0, "LEASED", "C"), shard(1, "OPEN")], "J"),
    ("the coordinator itself, judged by J, rejected by a verdict of an earlier term", "C", "C",
     [verdict("C", False, term=1)], [shard(0, "OPEN")], "J"),
    ("a judge naming the coordinator itself is no judge", "C", "C", [], [shard(0, "OPEN")], "C"),
    ("rejected in round 1 of term 1, claiming in round 2 of term 2 (a successor's view)", "W", "C2",
     [verdict("W", False, rnd=1, term=1)], [shard(0, "OPEN")]),
    ("accepted work never bans", "W", "C", [verdict("W", True), verdict("W", True, shard=1)], [shard(0, "OPEN")]),
    ("another worker's rejection does not ban this one", "W", "C", [verdict("X", False)], [shard(0, "OPEN")]),
    ("a live lease of the job: no second one", "W", "C", [], [shard(0, "LEASED", "W"), shard(1, "OPEN")]),
    ("a reported shard awaiting its verdict does not count", "W", "C", [], [shard(0, "REPORTED", "W"),
                                                                         shard(1, "OPEN")]),
]


def main() -> None:
    from protocol.messages import Verdict

    cases = []
    for name, worker, coordinator, verdicts, shards, *judged in CASES:
        judge = judged[0] if judged else None
        signed = [Verdict(JOB, v["round"], v["shard"], v["attempt"], v["worker"], v["term"], v["accepted"],
                          v["reason"], ()) for v in verdicts]
        states = [ShardState(s["index"], ShardPhase(s["phase"]), 1, s["worker"]) for s in shards]
        refusal = history_refusal(worker, coordinator, signed, states, judge)
        cases.append({"name": name, "worker": worker, "coordinator": coordinator, "judge": judge,
                      "verdicts": verdicts, "shards": shards, "lease": refusal is None, "refusal": refusal})
    doc = {
        "description": "IPIP-0004 §5.1 rule 0: whether the job's signed history forbids a lease to 'worker' when "
                       "'coordinator' coordinates: to the coordinator itself only when 'judge' (who judges its report, "
                       "IPIP-0006 judge_of; null: nobody) is another peer, never to a worker any verdict of "
                       "the job rejected (any round, any term), never a second live (LEASED) lease of the job. "
                       "Peer names stand for peer IDs. 'lease' is normative; 'refusal' is not.",
        "cases": cases,
    }
    Path("ipips/vectors/lease-history.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
