"""Run the protocol simulator (agent/harness/sim.py) and print its figures.

Usage::

    python scripts/simulate.py --agents 1000 --jobs 100 --churn 0.1 --byzantine 0.05 --hours 8 --seed 1
    python scripts/simulate.py --fake-fraction 0.34      # partial faking: escapes at 1 - catch probability
    python scripts/simulate.py --isolate-coordinator 30:20   # cut job 0's coordinator off at 30 min for 20 min

Prints a one-screen summary, then one JSON line per figure ({"bench": "sim_<name>", ...}); the
reference is null (a simulation has no baseline run) and the goal says what the figure should be.
The model and its parameters are ipips/0009-simulation.md; every SimConfig field has a default.
Every peer's mirror of a job is the agent's own (protocol/mirror.JobMirror), so the figures are
about that code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.harness.sim import Partition, SimConfig, simulate  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = SimConfig()
    parser = argparse.ArgumentParser(description="Simulate the job protocol at network scale.")
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--jobs", type=int, default=defaults.jobs)
    parser.add_argument("--churn", type=float, default=defaults.churn, help="fraction of agents leaving per hour")
    parser.add_argument("--byzantine", type=float, default=defaults.byzantine, help="fraction of Byzantine workers")
    parser.add_argument("--fake-fraction", type=float, default=defaults.fake_fraction,
                        help="share of its proof segments a Byzantine worker fakes (1 = all: always caught)")
    parser.add_argument("--hours", type=float, default=defaults.hours, help="simulated time limit")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--loss", type=float, default=defaults.loss, help="per-recipient message loss")
    parser.add_argument("--shards", type=int, default=defaults.shards)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--lease-seconds", type=float, default=defaults.lease_seconds)
    parser.add_argument("--worker-failure", type=float, default=defaults.worker_failure)
    parser.add_argument("--isolate-coordinator", metavar="START_MIN:MINUTES", default=None,
                        help="partition job 0's coordinator from everyone for a while")
    parser.add_argument("--no-reorder-buffer", action="store_true",
                        help="what-if: empty the mirror's held messages after each event (the agent before it held any)")
    parser.add_argument("--no-catch-up", action="store_true",
                        help="turn off the agent's catch-up and resync (a mirror keeps only what it heard live)")
    parser.add_argument("--repair", action="store_true",
                        help="what-if: a mirror asks the signers of worker messages it holds for their history "
                             "(protocol/resync.repair_sources; the agent's repair_from_senders)")
    parser.add_argument("--coordinators-dont-train", action="store_true",
                        help="remedy: a coordinator claims no shards, so its replays never wait for training")
    parser.add_argument("--verdict-margin", type=float, default=0.0, metavar="SECONDS",
                        help="remedy: a coordinator withholds a verdict this close to its verification window's end")
    parser.add_argument("--silent-holder-seconds", type=float, default=defaults.silent_holder_seconds,
                        metavar="SECONDS", help="a coordinator revokes the lease of a holder it has not heard for this "
                                                "long (IPIP-0004 §5.3; the agent's silent_holder_seconds); 0: never")
    parser.add_argument("--remedies", action="store_true", help="every what-if remedy (coordinators don't train, verdict margin 60 s)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON lines")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> SimConfig:
    partitions = ()
    if args.isolate_coordinator:
        start, minutes = (float(x) for x in args.isolate_coordinator.split(":"))
        partitions = (Partition(start * 60, (start + minutes) * 60, coordinator_of=0),)
    return SimConfig(agents=args.agents, jobs=args.jobs, churn=args.churn, byzantine=args.byzantine,
                     fake_fraction=args.fake_fraction, hours=args.hours, seed=args.seed, loss=args.loss,
                     shards=args.shards, rounds=args.rounds, lease_seconds=args.lease_seconds,
                     worker_failure=args.worker_failure, partitions=partitions,
                     reorder_buffer=not args.no_reorder_buffer, catch_up=not args.no_catch_up,
                     repair=args.repair and not args.no_catch_up,
                     coordinators_train=not (args.coordinators_dont_train or args.remedies),
                     verdict_margin=args.verdict_margin or (60.0 if args.remedies else 0.0),
                     silent_holder_seconds=args.silent_holder_seconds)


def figures(summary: dict, wall: float, config: SimConfig) -> list[dict]:
    def fig(name: str, value, unit: str, goal) -> dict:
        return {"bench": f"sim_{name}", "value": value, "unit": unit, "reference": None, "ratio": None, "goal": goal}

    def rounded(x):
        return None if x is None else round(x, 4)

    return [
        fig("completion_rate", rounded(summary["completion_rate"]), "fraction", 1.0),
        fig("jobs_failed", summary["failed"], "jobs", 0),
        fig("jobs_unfinished", summary["running_at_end"], "jobs", 0),
        fig("published_but_failed", summary["published_but_failed"], "jobs", 0),
        fig("publish_minutes_p50", rounded(summary["publish_minutes_p50"]), "min", None),
        fig("publish_minutes_p95", rounded(summary["publish_minutes_p95"]), "min", None),
        fig("messages_per_job", rounded(summary["messages_per_job"]), "messages", None),
        fig("claims_per_job", rounded(summary["messages_by_kind"]["claim"] / max(1, summary["jobs"])), "messages",
            None),
        fig("heartbeats", summary["heartbeats"], "messages", None),
        fig("reassignments", summary["reassignments"], "leases", None),
        fig("failovers", summary["failovers"], "failovers", None),
        fig("late_takeovers", summary["late_takeovers"], "takeovers", 0),
        fig("mirrors_diverged", rounded(summary["mirrors_diverged"] / max(1, summary["mirrors"])), "fraction", 0.0),
        fig("mirror_warnings", sum(summary["mirror_warnings"].values()), "warnings", 0),
        fig("byzantine_rejected", summary["byzantine_rejected"], "reports", None),
        fig("byzantine_accepted", summary["byzantine_accepted"], "reports", 0 if config.fake_fraction == 1 else None),
        fig("byzantine_escape_rate", rounded(summary["byzantine_escape_rate"]), "fraction",
            rounded(summary["byzantine_escape_expected"])),
        fig("wall_seconds", round(wall, 2), "s", 60),
    ]


def print_summary(s: dict, config: SimConfig, wall: float) -> None:
    remedies = [name for name, on in (("reorder buffer", config.reorder_buffer), ("catch-up", config.catch_up),
                                      ("repair", config.repair and config.catch_up),
                                      ("coordinators don't train", not config.coordinators_train),
                                      (f"verdict margin {config.verdict_margin:g} s", config.verdict_margin)) if on]
    print(f"simulated {config.agents} agents, {config.jobs} jobs ({config.shards} shards x {config.rounds} rounds), "
          f"churn {config.churn:g}/h, Byzantine {config.byzantine:g} faking {config.fake_fraction:g}, "
          f"seed {config.seed}; remedies: {', '.join(remedies) or 'none (the agent as built)'}")
    print(f"  {s['sim_hours']:.2f} simulated hours, {s['events']:,} events, {wall:.1f} s wall; "
          f"digest {s['digest'][:16]}")
    p50, p95 = s["publish_minutes_p50"], s["publish_minutes_p95"]
    print(f"  jobs: {s['done']} published, {s['failed']} failed, {s['running_at_end']} unfinished; "
          f"time to publish p50 {p50 or 0:.0f} min, p95 {p95 or 0:.0f} min")
    for reason, n in s["failure_reasons"].items():
        print(f"    failed x{n}: {reason}")
    print(f"  final aggregates published by a coordinator: {s['published']} "
          f"({s['published_but_failed']} of them in jobs whose submitter's mirror diverged and failed)")
    kinds = ", ".join(f"{k} {v:,}" for k, v in s["messages_by_kind"].items())
    print(f"  messages per job {s['messages_per_job']:,.0f} ({kinds}); heartbeats {s['heartbeats']:,}")
    reasons = ", ".join(f"{r} x{n}" for r, n in s["reassignment_reasons"].items())
    print(f"  reassignments {s['reassignments']}: {reasons}")
    print(f"  coordinator failovers {s['failovers']} (takeovers {s['takeovers']}, by a returning agent "
          f"with a partial mirror {s['late_takeovers']})")
    print(f"  Byzantine reports rejected {s['byzantine_rejected']}, ACCEPTED {s['byzantine_accepted']} "
          f"(escape rate {s['byzantine_escape_rate']:.3f}, "
          f"1 - catch probability {s['byzantine_escape_expected']:.3f}); "
          f"honest reports accepted {s['honest_accepted']}")
    print(f"  mirrors at the end: {s['mirrors']}, diverged from the submitter's {s['mirrors_diverged']}; "
          f"histories taken in {s['mirror_syncs']}; "
          f"events refused by mirrors: " + ", ".join(f"{k} {v:,}" for k, v in s["refused_events"].items()))
    if s["mirror_warnings"]:
        print("  mirror warnings (protocol/mirror.py): " + ", ".join(f"{k!r} x{v:,}" for k, v in s["mirror_warnings"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from(args)
    started = time.perf_counter()
    result = simulate(config)
    wall = time.perf_counter() - started
    summary = result.summary()
    if not args.json_only:
        print_summary(summary, config, wall)
    for line in figures(summary, wall, config):
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
