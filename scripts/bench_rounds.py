"""Round utilization: how much of a job's wall time its workers spend training (issue 24 §3).

Runs a real network with the demo job's settings (4 shards of the demo task, 12 steps a round,
rank 16 on every projection, replay verification of one segment): a submitter and W workers, every
worker an `infernet agent run` process on a host of its own (network namespaces,
agent/harness/hosts.py), first on unshaped links, then with every link adding ``--delay`` ms to a
round trip at ``--rate`` Mbit/s. From the run's trace (``trace.jsonl``: every message the submitter
received, with the harness's clock) it takes, per shard report, the worker's signed training seconds
(``metrics.train_seconds``) ending when the report arrived, and each round's end (its aggregate's
arrival), and computes with agent/utilization.py (the same code `job show` uses):

- worker_utilization/<shape>/<worker>: training / (training + idle between its shards), per worker;
  ``.../mean`` their mean. Reference 1.0, goal 0.9.
- round_fixed_cost/<shape>: the mean over rounds of (round wall time - the busiest worker's
  training in it), in seconds; reference: the mean round wall time; ratio = the critical path's
  share of a round (busiest / wall), goal 0.9.
- job_speedup/<shape>: machines' worth of training per second of the job's wall time; reference W;
  ratio = speedup / W.

How it is measured on this 2-core machine: W workers share 2 cores, so a worker's training takes
longer than alone and the coordinator's replay competes with training; the figures are per worker,
read off the real timings, and say what they are on this machine, not on one GPU per worker.
Needs root, `ip`, `iptables` (else it prints ``skipped: ...`` to stderr and exits 0).
Usage: python scripts/bench_rounds.py [--workers 4] [--rounds 6] [--steps 12] [--delay 80] [--rate 20] [--no-wan]
       [--codec none|int8|int4|int4-log|int4-fresh] [--aggregate-codec none|...] [--coordinator-trains]
       [--no-early-start]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.harness.hosts import delay_method, unavailable_reason  # noqa: E402
from agent.utilization import Trained, Utilization, measure  # noqa: E402

GOAL = 0.9


def emit(bench: str, value: float, unit: str, reference: float, ratio: float, goal: float | None, **extra) -> None:
    print(json.dumps({"bench": bench, "value": round(value, 4), "unit": unit, "reference": round(reference, 4),
                      "ratio": round(ratio, 4), "goal": goal, **extra}), flush=True)


def scenario_text(workers: int, rounds: int, steps: int, link: str, codec: str = "none",
                  coordinator_trains: bool = False, early_start: bool = True, aggregate_codec: str = "none") -> str:
    names = [f"w{i}" for i in range(workers)]
    hosts = "\n".join(f"  {'home' if n == 'submitter' else 'h' + n}: {{agents: [{n}]{link}}}"
                      for n in ["submitter", *names])
    targets = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
    return f"""name: bench-rounds
timeout: {300 + 30 * rounds}
agents:
  workers: {workers}
  records: 400
  config: {{all: {{coordinator_trains: {str(coordinator_trains).lower()}, early_start: {str(early_start).lower()}}}}}
hosts:
{hosts}
job:
  shards: 4
  rounds: {rounds}
  training: {{learning_rate: 0.01, batch_size: 8, max_steps: {steps}, max_seq_len: 96, report_codec: {codec}, aggregate_codec: {aggregate_codec}}}
  lora: {{rank: 16, alpha: 32, target_modules: {targets}}}
  aggregation: exact
  max_retries: 2
  proof: {{checkpoint_every: {max(1, steps // 4)}, verify_segments: 1}}
  lease_seconds: 120
expect:
  phase: DONE
"""


def from_trace(path: Path) -> Utilization:
    """The figures from a harness trace: the first arrival of each lease, report and aggregate at any
    traced agent (here the submitter), on the harness's clock."""
    from agent.harness.trace import read_trace

    first: dict[tuple, float] = {}
    reports: dict[tuple, tuple[str, float]] = {}
    for line in read_trace(path):
        if line.get("kind") != "recv" or line.get("topic") != "job":
            continue
        kind = line.get("type")
        if kind in ("lease", "report"):
            key = (kind, line["round"], line["shard"], line["attempt"])
        elif kind == "aggregate":
            key = (kind, line["round"])
        else:
            continue
        if key in first:
            continue
        first[key] = line["t"]
        if kind == "report":
            reports[key] = (line["from"], float((line.get("metrics") or {}).get("train_seconds", 0.0)))
    trained = [Trained(worker, key[1], first[key], seconds) for key, (worker, seconds) in reports.items()]
    ends = {key[1]: t for key, t in first.items() if key[0] == "aggregate"}
    starts = [t for key, t in first.items() if key[0] == "lease" and key[1] == 1]
    return measure(trained, ends, min(starts) if starts else None)


def phases(path: Path) -> dict[str, float]:
    """Where a round's wall time goes, from the same trace (mean over rounds, seconds): ``leasing``
    (round start to its last lease), ``training`` (last lease to last report), ``verifying`` (last
    report to last verdict), ``aggregating`` (last verdict to the aggregate); and per shard
    ``worker_overhead`` (lease to report minus the signed training seconds: fetching the round's
    start, loading, packing and publishing)."""
    from agent.harness.trace import read_trace

    seen: set = set()
    rounds: dict[int, dict[str, list[float]]] = {}
    leased: dict[tuple, float] = {}
    overhead: list[float] = []
    for line in read_trace(path):
        if line.get("kind") != "recv" or line.get("topic") != "job" or "round" not in line:
            continue
        kind = line.get("type")
        key = (kind, line["round"], line.get("shard"), line.get("attempt"))
        if key in seen or kind not in ("lease", "report", "verdict", "aggregate"):
            continue
        seen.add(key)
        rounds.setdefault(line["round"], {}).setdefault(kind, []).append(line["t"])
        if kind == "lease":
            leased[key[1:]] = line["t"]
        elif kind == "report" and key[1:] in leased:
            seconds = float((line.get("metrics") or {}).get("train_seconds", 0.0))
            overhead.append(line["t"] - leased[key[1:]] - seconds)
    parts: dict[str, list[float]] = {"leasing": [], "training": [], "verifying": [], "aggregating": []}
    for rnd, times in sorted(rounds.items()):
        start = rounds.get(rnd - 1, {}).get("aggregate", [None])[0] if rnd > 1 else min(times.get("lease", [0.0]))
        if start is None or not all(times.get(k) for k in ("lease", "report", "verdict", "aggregate")):
            continue
        lease, report_, verdict, aggregate = (max(times[k]) for k in ("lease", "report", "verdict", "aggregate"))
        parts["leasing"].append(lease - start)
        parts["training"].append(report_ - lease)
        parts["verifying"].append(verdict - report_)
        parts["aggregating"].append(aggregate - verdict)
    out = {name: round(sum(v) / len(v), 3) for name, v in parts.items() if v}
    if overhead:
        out["worker_overhead"] = round(sum(overhead) / len(overhead), 3)
    return out


def run_once(args: argparse.Namespace, shape: str, link: str) -> Utilization | None:
    from agent.harness.scenario import parse_scenario, run_scenario
    from agent.train.tiny import tiny_model

    text = scenario_text(args.workers, args.rounds, args.steps, link, args.codec, args.coordinator_trains,
                         not args.no_early_start, args.aggregate_codec)
    scenario = parse_scenario(text, "bench-rounds")
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as out:
        result = trio.run(lambda: run_scenario(scenario, Path(out), model_dir=tiny_model()))
        if not result.ok or result.trace_path is None:
            print(f"skipped: {shape}: the job did not end DONE: {result.summary}", file=sys.stderr, flush=True)
            return None
        figures = from_trace(result.trace_path)
        print(f"# {shape}: job {result.seconds:.1f} s; " + json.dumps(figures.as_json()), file=sys.stderr, flush=True)
        print(f"# {shape}: a round's phases (s, mean): " + json.dumps(phases(result.trace_path)), file=sys.stderr, flush=True)
        return figures


def report(shape: str, u: Utilization, workers: int, **extra) -> None:
    for worker, f in sorted(u.workers.items()):
        emit(f"worker_utilization/{shape}/{worker}", f.utilization, "fraction", 1.0, f.utilization, GOAL,
             training_s=round(f.training, 2), idle_s=round(f.idle, 2), shards=f.shards, **extra)
    if u.workers:
        mean = sum(f.utilization for f in u.workers.values()) / len(u.workers)
        emit(f"worker_utilization/{shape}/mean", mean, "fraction", 1.0, mean, GOAL, **extra)
    if u.rounds:
        wall = u.wall_seconds / len(u.rounds)
        emit(f"round_fixed_cost/{shape}", u.fixed_per_round, "s", wall, (wall - u.fixed_per_round) / wall if wall else 0.0,
             GOAL, rounds=len(u.rounds), **extra)
        emit(f"job_speedup/{shape}", u.speedup, "machines", float(workers), u.speedup / workers, None, **extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12, help="inner steps a round (the demo's default 12)")
    parser.add_argument("--delay", type=float, default=80.0, help="ms each link adds to a round trip")
    parser.add_argument("--rate", type=float, default=20.0, help="each link's rate, Mbit/s")
    parser.add_argument("--no-wan", action="store_true", help="only the unshaped run")
    parser.add_argument("--codec", default="none", help="the job's training.report_codec: none | int8 | int4 | int4-log | int4-fresh")
    parser.add_argument("--aggregate-codec", default="none",
                        help="the job's training.aggregate_codec: each round's start travels as an update (IPIP-0006 §2.8.1)")
    parser.add_argument("--coordinator-trains", action="store_true",
                        help="the agents' coordinator_trains: the coordinator trains one shard a round too")
    parser.add_argument("--no-early-start", action="store_true",
                        help="the agents' early_start off: a round's next one starts after its aggregate (IPIP-0006 §2.9)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"skipped: all: {reason}", file=sys.stderr)
        return 0
    shapes = [("unshaped", "")]
    if not args.no_wan:
        if delay_method():
            shapes.append((f"{args.delay:g}ms", f", link: {{delay: {args.delay:g}ms, rate: {args.rate:g}mbit}}"))
        else:
            print("skipped: wan: no way to delay a link here (no sch_netem, no NFQUEUE delayer)", file=sys.stderr)
    for shape, link in shapes:
        figures = run_once(args, shape, link)
        if figures is not None:
            report(shape, figures, args.workers, steps=args.steps, shaper=delay_method() if link else None,
                   codec=args.codec, aggregate_codec=args.aggregate_codec, coordinator_trains=args.coordinator_trains,
                   early_start=not args.no_early_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
