"""Live progress of one job for a person: a rich table on a terminal, one line per change elsewhere.

Fed with the control channel's job detail (agent/control.py ``job_detail``) every poll; knows nothing
else. ``json_lines=True`` prints each changed detail as one JSON line instead (``job watch --json``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"OPEN": "dim", "LEASED": "yellow", "REPORTED": "cyan", "ACCEPTED": "green", "FAILED": "red"}


class JobProgress:
    def __init__(self, *, json_lines: bool = False, console: Console | None = None) -> None:
        self.console = console or Console()
        self.json_lines = json_lines
        self.live: Live | None = None
        self.started = time.monotonic()
        self._last_lines: dict[str, str] = {}

    def __enter__(self) -> "JobProgress":
        if not self.json_lines and self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, job: dict) -> None:
        if self.json_lines:
            line = json.dumps(job, sort_keys=True, default=str)
            if line != self._last_lines.get("json"):
                print(line, flush=True)
                self._last_lines["json"] = line
        elif self.live is not None:
            self.live.update(self.render(job))
        else:
            self._print_changes(job)

    def render(self, job: dict) -> Group:
        elapsed = time.monotonic() - self.started
        coordinator = (job.get("coordinator") or "-")[-8:]
        head = Text.assemble(
            ("job ", "bold"), job["id"][:16], "  ", (job["state"], "bold"),
            f"  round {job['round']}/{job['rounds']}  coordinator …{coordinator} (term {job['term']})",
            f"  leases {job.get('leases', 0)}  verdicts {job.get('verdicts', {}).get('accepted', 0)} accepted"
            f" / {job.get('verdicts', {}).get('rejected', 0)} rejected  {elapsed:.0f} s")
        table = Table(box=None, pad_edge=False)
        for column in ("shard", "state", "attempt", "worker", "step", "loss", "verdict"):
            table.add_column(column, justify="right" if column in ("shard", "attempt", "step", "loss") else "left")
        for s in job.get("shard_states", []):
            verdict = s.get("verdict")
            table.add_row(str(s["index"]), Text(s["state"], style=STATE_STYLE.get(s["state"], "")), str(s["attempt"]),
                          f"…{s['worker'][-8:]}" if s.get("worker") else "-", str(s.get("step") or 0),
                          f"{s['loss']:.3f}" if s.get("loss") is not None else "-",
                          _verdict_text(verdict, 40))
        rows: list[Any] = [head, table]
        timing = round_timing(job)
        for agg in job.get("aggregates", []):
            rows.append(Text(f"round {agg['round']} aggregate {agg['cid']} ({agg['method']} over shards {agg['shards']})"
                             + aggregate_score(agg) + timing.get(agg["round"], ""), style="green"))
        if line := utilization_line(job):
            rows.append(Text(line))
        for item in job.get("not_held", []):  # the submitter keeps trying to hold a copy
            what = f"shard {item['shard']} adapter" if item["kind"] == "adapter" else "aggregate"
            rows.append(Text(f"round {item['round']} {what} {item['cid']}: accepted, not yet held by the submitter",
                             style="yellow"))
        budget = job.get("budget") or {}
        if budget.get("paid"):  # a paid job: what its accepted work cost, and why leasing stopped (IPIP-0004 §12)
            rows.append(Text(f"budget: {budget['spent']:.4f} of {budget['total']:g} spent at {budget['price_per_hour']:g}/h"
                             + (f"; leasing stopped: {budget['leasing_stopped']}" if budget.get("leasing_stopped") else ""),
                             style="yellow" if budget.get("leasing_stopped") else ""))
        if job.get("waiting"):
            rows.append(Text(f"waiting: {job['waiting']}", style="yellow"))
        if job.get("reason"):
            rows.append(Text(f"ended: {job['reason']}", style="bold"))
        return Group(*rows)

    def _print_changes(self, job: dict) -> None:
        """Not a terminal: one line per change of the job or of a shard."""
        stamp = f"[{time.monotonic() - self.started:5.1f}s]"
        lines = {"job": f"job {job['id'][:12]} {job['state']} round {job['round']}/{job['rounds']} "
                        f"coordinator …{(job.get('coordinator') or '-')[-8:]} term {job['term']}"}
        for s in job.get("shard_states", []):
            verdict = s.get("verdict")
            lines[f"shard{s['index']}"] = (
                f"  r{job['round']} shard {s['index']} {s['state']} attempt {s['attempt']}"
                + (f" worker …{s['worker'][-8:]}" if s.get("worker") else "")
                + (f" step {s['step']} loss {s['loss']:.3f}" if s.get("loss") is not None else "")
                + ("" if verdict is None else " " + _verdict_text(verdict, 60)))
        timing = round_timing(job)
        for agg in job.get("aggregates", []):
            lines[f"agg{agg['round']}"] = (f"  round {agg['round']} aggregate {agg['cid']}" + aggregate_score(agg)
                                           + timing.get(agg["round"], ""))
        for key, line in lines.items():
            if self._last_lines.get(key) != line:
                print(f"{stamp} {line.strip() if key == 'job' else line}", flush=True)
                self._last_lines[key] = line

    def final_line(self, job: dict) -> str:
        if job["state"] == "DONE":
            line = utilization_line(job)
            return f"job {job['id'][:16]} DONE: final aggregate {job['published'][-1]}" + (f"\n{line}" if line else "")
        return f"job {job['id'][:16]} {job['state']}: {job.get('reason') or 'no reason given'}"


def _verdict_text(verdict: dict | None, width: int) -> str:
    if verdict is None:
        return "-"
    return "accepted" if verdict["accepted"] else f"rejected: {verdict['reason'][:width]}"


def aggregate_score(agg: dict) -> str:
    """``  validation loss 0.412`` (``  validation loss 9.32 -> 0.412`` in round 1), or nothing; a DPO job's
    with ``, reward accuracy 0.88, margin 3.1``."""
    loss, base = agg.get("validation_loss"), agg.get("base_validation_loss")
    if loss is None:
        return ""
    text = f"  validation loss {base:.3f} -> {loss:.3f}" if base is not None else f"  validation loss {loss:.3f}"
    if agg.get("reward_accuracy") is not None:
        text += f", reward accuracy {agg['reward_accuracy']:.2f}, margin {agg['reward_margin']:.2f}"
    return text


def round_timing(job: dict) -> dict[int, str]:
    """Per finished round: ``  (3.0 s: busiest worker trained 1.7 s, fixed 1.3 s; 1.6 machines' worth)``:
    the round's training, all workers together, over its wall time."""
    out = {}
    for r in (job.get("utilization") or {}).get("rounds", []):
        worth = r["training"] / r["wall"] if r["wall"] > 0 else 0.0
        out[r["round"]] = (f"  ({r['wall']:.1f} s: busiest worker trained {r['busiest']:.1f} s, fixed {r['fixed']:.1f} s; "
                           f"{worth:.1f} machines' worth)")
    return out


def utilization_line(job: dict) -> str:
    """The job's use of its workers (agent/utilization.py), once a round is finished; else ''."""
    u = job.get("utilization") or {}
    if not u.get("rounds"):
        return ""
    workers = u.get("workers", {})
    return (f"workers busy {u['utilization']:.0%} of their time ({len(workers)} worker(s), "
            f"{u['training_seconds']:.0f} s training over {u['wall_seconds']:.0f} s of rounds): "
            f"{u['speedup']:.2f} machines' worth of training at once; the speedup over one of them is that "
            f"x the job's distributed efficiency E (scripts/bench_quality.py); fixed cost {u['fixed_per_round']:.1f} s a round")
