"""Write ipips/vectors/lease-history.json (IPIP-0004 §5.1 rule 0: who the job's signed history forbids a
lease to) and lease-silent.json (§5.3: whose lease a coordinator revokes, its holder silent); reviewed by hand.
Run from the repository root."""
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from protocol.leasing import history_refusal, silent_holders  # noqa: E402
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
    silent()


def held(index: int, phase: str, worker: str | None, leased_at: float | None) -> dict:
    """A shard whose lease (or last checkpoint) came at ``leased_at``: expires_at is that + lease_seconds."""
    return {"index": index, "phase": phase, "worker": worker,
            "expires_at": None if leased_at is None else leased_at + 3600.0}


SILENT_BASE = {"coordinator": "C", "now": 1000.0, "lease_seconds": 3600.0, "silent_seconds": 15.0, "silence": 5.0,
               "hearing_since": 900.0}
SILENT_CASES = [
    ("a holder silent for 20 s while another peer is heard: revoked",
     {"heard": {"W": 980.0, "X": 999.5}, "shards": [held(0, "LEASED", "W", 950.0)]}),
    ("silent for 14 s: not yet",
     {"heard": {"W": 986.0, "X": 999.5}, "shards": [held(0, "LEASED", "W", 950.0)]}),
    ("its heartbeats stopped but a checkpoint came 10 s ago (expires_at - lease_seconds): not silent",
     {"heard": {"W": 960.0, "X": 999.5}, "shards": [held(0, "LEASED", "W", 990.0)]}),
    ("never heard, leased 16 s ago: revoked",
     {"heard": {"X": 999.5}, "shards": [held(0, "LEASED", "W", 984.0)]}),
    ("never heard, leased 10 s ago: the lease's own time counts",
     {"heard": {"X": 999.5}, "shards": [held(0, "LEASED", "W", 990.0)]}),
    ("nobody else heard within the silence either (our own loop stalled, or we are cut off): nothing",
     {"heard": {"W": 980.0, "X": 990.0}, "shards": [held(0, "LEASED", "W", 950.0)]}),
    ("we have heard peers for only 10 s (we restarted): nothing",
     {"heard": {"W": 980.0, "X": 999.5}, "shards": [held(0, "LEASED", "W", 950.0)], "hearing_since": 990.0}),
    ("we hear nobody (hearing_since null): nothing",
     {"heard": {"W": 980.0, "X": 999.5}, "shards": [held(0, "LEASED", "W", 950.0)], "hearing_since": None}),
    ("the coordinator's own lease: never",
     {"heard": {"X": 999.5}, "shards": [held(0, "LEASED", "C", 950.0)]}),
    ("a reported shard is verified, never revoked",
     {"heard": {"W": 980.0, "X": 999.5}, "shards": [held(0, "REPORTED", "W", 950.0)]}),
    ("revocation off (silent_seconds 0)",
     {"heard": {"W": 980.0, "X": 999.5}, "shards": [held(0, "LEASED", "W", 950.0)], "silent_seconds": 0.0}),
    ("two holders, one silent: only its shard",
     {"heard": {"W": 980.0, "V": 999.0, "X": 999.5},
      "shards": [held(0, "LEASED", "W", 950.0), held(1, "LEASED", "V", 950.0), held(2, "OPEN", None, None)]}),
    ("the only other peer heard is the silent holder's own name: nothing (another peer must be live)",
     {"heard": {"W": 980.0}, "shards": [held(0, "LEASED", "W", 950.0)]}),
]


def silent() -> None:
    cases = []
    for name, given in SILENT_CASES:
        case = {"name": name, **SILENT_BASE, **given}
        shards = [ShardState(s["index"], ShardPhase(s["phase"]), 1, s["worker"], s["expires_at"]) for s in case["shards"]]
        revoke = silent_holders(shards, case["coordinator"], case["heard"], case["now"], case["lease_seconds"],
                                case["silent_seconds"], case["silence"], case["hearing_since"])
        cases.append({**case, "revoke": [[index, round(seconds, 3)] for index, seconds in revoke]})
    doc = {
        "description": "IPIP-0004 §5.3: which leases a job's coordinator ends because it no longer hears their "
                       "holder. 'heard': when the coordinator last heard each peer's heartbeat; a shard's expires_at - "
                       "lease_seconds is its last lease or checkpoint. A holder is silent when neither came in the "
                       "last silent_seconds; nothing is revoked unless the coordinator has heard peers without a break "
                       "for silent_seconds (hearing_since: by heartbeats) and another peer is live to it now (heard within "
                       "'silence'), and never the coordinator's own lease. 'revoke': [shard, seconds silent] in shard "
                       "order, normative.",
        "cases": cases,
    }
    Path("ipips/vectors/lease-silent.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
