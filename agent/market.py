"""The market, as one agent sees it: providers, measured speed, estimates, budgets, reputation, bills.

Rules of this file (the rules themselves are protocol/market.py and IPIP-0004 §12):
- **Speed is measured, not assumed.** A training agent measures its tokens/s for each base model it
  holds once, with a short real training burst (``BURST_STEPS`` steps of the tiny demo data on the
  model, through agent/train like any shard), and keeps it in ``<home>/speeds.json`` keyed by the
  model's hash, the device and the thread count, so a restart does not measure again. Each real
  shard it trains replaces the figure with that shard's own tokens/s. The figures go into the
  signed capability (``Capability.speeds``). ``measure_speed`` (config) turns the burst off.
- **Providers and models** are read off the signed capabilities and heartbeats the agent hears
  (``providers``, ``models``): nothing is asked of the peers.
- **Reputation** is counted from the signed leases, reports and verdicts this agent's mirrors
  applied, for every job in its store (the evidence behind its ledger, IPIP-0008 §4); a finished
  job's counts are kept once computed; recomputed at most every ``REPUTATION_TTL`` seconds.
- **Budget.** Every mirror computes the same committed cost (accepted + reported awaiting a
  verdict) from the same signed reports and verdicts, so the coordinator stops leasing, workers stop claiming and ``job show`` says why at
  the same point. The submitter role then cancels the job once nothing it leased is still in flight
  (agent/roles/submitter.py ``_watch_budget``), with the budget's reason.
- **Bills** are the submitter's settlement record: made from the accepted attempts' signed reports,
  signed by the submitter's identity (domain ``infernet/bill/v1``), appended to the job's ledger
  as a ``bill`` entry (its hash and totals), and checked against the ``report`` and ``verdict``
  entries of every ledger chain of the job the agent holds, its own and its copies of the others'
  (``ledger_check``; ``job bill`` pulls the participants' chains first). A verdict entry counts only
  when written by the signer of the Verdict our mirror applied for that attempt (the store's
  ``verdicts.coordinator``); anyone else's is listed in ``ignored``, never a problem. No chain, no token.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from functools import partial
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from protocol import market as mk
from protocol import messages as m
from protocol import state as st

if TYPE_CHECKING:
    from protocol.mirror import JobMirror

log = logging.getLogger(__name__)

# ``agent`` below is the running agent (agent/node.py ``Agent``; the worker hands ``worker_refusal`` its ``Local``), typed
# loosely: the node imports this module, so this one does not import the node back (issue 23)
Agent = Any
Capabilities = Any  # agent/capability.py ``Capabilities``, which reads our cached speeds from here

SPEEDS_FILE = "speeds.json"
BURST_STEPS = 6
REPUTATION_TTL = 5.0


# -- measured speed -----------------------------------------------------------------------------------

def _speed_key(sha256: str, device: str, threads: int) -> str:
    return f"{sha256}/{device}/{threads}"


def load_speeds(home: Path) -> dict:
    try:
        data = json.loads((home / SPEEDS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_speed(home: Path, sha256: str, device: str, threads: int, tokens_per_s: float, source: str) -> None:
    """Remember a measured speed (written to a temporary file, then renamed: never half-written)."""
    data = load_speeds(home)
    data[_speed_key(sha256, device, threads)] = {"sha256": sha256, "device": device, "threads": threads,
                                                  "tokens_per_s": float(tokens_per_s), "source": source,
                                                  "measured_at": time.time()}
    tmp = home / (SPEEDS_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, home / SPEEDS_FILE)


def device_name(caps: "Capabilities") -> str:
    machine = caps.machine
    if machine is not None and machine.cuda:
        return f"cuda:{max(machine.cuda, key=lambda d: d.vram_total_gb).name}"[:64]
    return "cpu"


def advertised_speeds(caps: "Capabilities") -> tuple[m.ModelSpeed, ...]:
    """The speeds our capability carries: those cached for the models we hold, on this device and thread count."""
    data = load_speeds(caps.config.home)
    device, out = device_name(caps), []
    for held in caps.models_held:
        entry = data.get(_speed_key(held.sha256.hex(), device, caps.config.threads))
        if entry and isinstance(entry.get("tokens_per_s"), (int, float)) and 0 < entry["tokens_per_s"] <= 1e9:
            out.append(m.ModelSpeed(held.sha256, float(entry["tokens_per_s"]), device))
    return tuple(out)


def burst_tokens_per_s(model_path: str, sha256: str, threads: int) -> float:
    """Train ``BURST_STEPS`` real steps on the model (tiny demo data, rank 8) and return tokens/s."""
    from agent.train import TrainConfig, TrainRequest, train_shard
    from agent.train.data import write_chatml
    from agent.train.tiny import demo_records

    with tempfile.TemporaryDirectory(prefix="infernet-speed-") as tmp:
        data = Path(tmp) / "burst.jsonl"
        write_chatml(data, demo_records(48, seed=1))
        config = TrainConfig(base_model=model_path, base_model_sha256=sha256, seed=0, learning_rate=1e-4,
                             batch_size=4, max_steps=BURST_STEPS, max_seq_len=128, rank=8, alpha=16.0,
                             checkpoint_every=BURST_STEPS, verify_segments=0, threads=threads)
        result = train_shard(TrainRequest(config, data, Path(tmp) / "run"))
        return result.tokens_per_second


async def measure_speeds(caps: "Capabilities") -> None:
    """Measure each held model not measured yet on this device (one burst each), then re-advertise."""
    from agent.train.runner import run_torch

    config = caps.config
    device, cached = device_name(caps), load_speeds(config.home)
    measured = False
    for name, path in config.models:
        held = next((h for h in caps.models_held if h.name == name[:m.MAX_STR]), None)
        if held is None or _speed_key(held.sha256.hex(), device, config.threads) in cached:
            continue
        try:
            speed = await trio.to_thread.run_sync(run_torch, burst_tokens_per_s, path, held.sha256.hex(),
                                                  config.threads, abandon_on_cancel=True)  # a stop waits not
        except Exception as exc:  # noqa: BLE001 - a model we cannot train here is advertised without a speed
            log.warning("model %s: speed not measured: %s", name, exc)
            continue
        if speed > 0:
            save_speed(config.home, held.sha256.hex(), device, config.threads, speed, "burst")
            log.info("model %s: %.0f tokens/s on %s (%d threads)", name, speed, device, config.threads)
            measured = True
    if measured:
        caps.reload_speeds()
        with trio.move_on_after(10):
            await caps.publish()


def record_shard_speed(caps: "Capabilities", terms: m.JobTerms, tokens_per_s: float) -> None:
    """A real shard's speed replaces the cached figure for its model (advertised from the next capability)."""
    if tokens_per_s <= 0 or not any(h.sha256 == terms.base_model_sha256 for h in caps.models_held):
        return
    try:
        save_speed(caps.config.home, terms.base_model_sha256.hex(), device_name(caps), caps.config.threads,
                   tokens_per_s, "shard")
        caps.reload_speeds()
    except OSError as exc:
        log.info("speed not saved: %s", exc)


# -- budget -------------------------------------------------------------------------------------------

def accepted_attempts(view: "JobMirror") -> list[mk.Attempt]:
    """Every judged attempt of the job whose report we hold, as its signed messages state it."""
    out = []
    for key, verdict in sorted(view.verdicts.items()):
        report, worker = view.reports.get(key, (None, None))
        if report is None:
            continue
        out.append(mk.Attempt(worker, key[0], key[1], key[2], float(report.metrics.get("train_seconds", 0.0)),
                              verdict.accepted))
    return out


def spent(view: "JobMirror") -> float:
    """What the job's accepted attempts cost."""
    terms = view.terms
    return mk.accepted_cost(terms.price_per_hour, [a.train_seconds for a in accepted_attempts(view) if a.accepted])


def committed(view: "JobMirror") -> float:
    """``spent`` plus what the reported attempts awaiting their verdict would cost (protocol/market.py)."""
    pending = []
    for shard in view.state.shards:
        if shard.phase is st.ShardPhase.REPORTED:
            report, _ = view.reports.get((view.state.round, shard.index, shard.attempt), (None, None))
            if report is not None:
                pending.append(float(report.metrics.get("train_seconds", 0.0)))
    return spent(view) + mk.accepted_cost(view.terms.price_per_hour, pending)


def budget_reason(view: "JobMirror") -> str | None:
    return mk.budget_refusal(view.terms.price_per_hour, view.terms.budget, committed(view))


def lease_refusal(view: "JobMirror", worker: str) -> str | None:
    terms = view.terms
    return mk.lease_refusal(worker, price_per_hour=terms.price_per_hour, budget=terms.budget, spent=committed(view),
                            max_nodes=terms.max_nodes, providers=terms.providers,
                            leased_workers=[lease.worker for lease in view.leases.values()])


def worker_refusal(agent: "Agent", view_or_terms: Any) -> str | None:
    terms = getattr(view_or_terms, "terms", view_or_terms)
    used = committed(view_or_terms) if hasattr(view_or_terms, "verdicts") else 0.0
    if terms.providers and agent.peer_id not in terms.providers:
        return "this agent is not one of the job's named providers"
    return mk.worker_refusal(price_per_hour=terms.price_per_hour, budget=terms.budget, spent=used,
                             ask=agent.config.price_per_hour)


def budget_json(view: "JobMirror") -> dict:
    terms = view.terms
    return {"paid": mk.is_paid(terms.price_per_hour), "price_per_hour": terms.price_per_hour,
            "total": terms.budget, "spent": round(spent(view), 6), "committed": round(committed(view), 6),
            "max_nodes": terms.max_nodes,
            "providers": list(terms.providers), "leasing_stopped": budget_reason(view)}


# -- reputation ---------------------------------------------------------------------------------------

def view_outcomes(view: "JobMirror") -> dict[str, mk.Reputation]:
    leases = {key: lease.worker for key, lease in view.leases.items()}
    verdicts = {key: (v.worker, v.accepted) for key, v in view.verdicts.items()}
    # the shards' current attempts, also when the job ended: work a cancel cut short is nobody's fault
    current = {(view.state.round, s.index): s.attempt for s in view.state.shards}
    return mk.job_outcomes(leases, view.reports.keys(), verdicts, current)


class Reputations:
    """Per-worker counts across every job in our store (protocol/market.job_outcomes), cached."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
        self._finished: dict[bytes, dict[str, mk.Reputation]] = {}
        self._at = -1e18
        self._value: dict[str, mk.Reputation] = {}

    def get(self) -> dict[str, mk.Reputation]:
        agent = self.agent
        now = agent.clock()
        if now - self._at < REPUTATION_TTL:
            return self._value
        parts = []
        for record in agent.store.jobs():
            if record.job_id in self._finished:
                parts.append(self._finished[record.job_id])
                continue
            view = agent.jobs.get(record.job_id)
            try:
                view = view if view is not None else agent.job_view(record.job_id)
            except Exception as exc:  # noqa: BLE001 - a job we cannot rebuild counts for nothing
                log.info("job %s: not counted in reputations: %s", record.job_id.hex()[:8], exc)
                continue
            outcome = view_outcomes(view)
            if view.state.terminal:
                self._finished[record.job_id] = outcome
            parts.append(outcome)
        self._value, self._at = mk.merge_reputations(parts), now
        return self._value


# -- providers and models -----------------------------------------------------------------------------

def providers(agent: "Agent") -> list[dict]:
    """Each peer whose signed capability we hold: hardware, models, runtimes, price, busy or idle,
    shards in progress, measured speeds and reputation."""
    now, live = agent.clock(), agent.live_peers()
    reps = agent.reputations.get()
    out = []
    for peer, info in sorted(agent.peers.items()):
        cap = info.capability
        if peer == agent.peer_id or cap is None:
            continue
        gpus = [{"name": d.name, "vram_total_gb": d.vram_total_gb, "vram_free_gb": d.vram_free_gb} for d in cap.devices]
        names = {h.sha256: h.name for h in cap.models}
        out.append({
            "peer_id": peer, "live": peer in live, "last_heartbeat_s": round(now - info.last_heartbeat, 1),
            "device": cap.hardware.device, "hardware": cap.hardware.device_name, "vram_gb": cap.hardware.vram_gb,
            "ram_gb": cap.hardware.ram_gb, "cpu_threads": cap.hardware.cpu_threads, "gpus": gpus,
            "models": [{"name": h.name, "sha256": h.sha256.hex()} for h in cap.models],
            "runtimes": list(cap.backends), "price_per_hour": cap.price_per_hour,
            "accepts_training": cap.accepts_training, "can_coordinate": cap.can_coordinate,
            "busy": info.active_shards > 0, "shards_in_progress": info.active_shards,
            "max_concurrent_shards": cap.max_concurrent_shards, "version": cap.agent_version,
            "speeds": [{"model": names.get(s.sha256, ""), "sha256": s.sha256.hex(), "tokens_per_s": s.tokens_per_s,
                        "device": s.device} for s in cap.speeds],
            "reputation": reps.get(peer, mk.Reputation()).to_json(),
        })
    return out


def models(agent: "Agent") -> list[dict]:
    """Each base model (name + hash) the live peers hold, with how many of them hold it and train."""
    live = agent.live_peers()
    table: dict[tuple[str, str], dict] = {}
    for peer, info in agent.peers.items():
        cap = info.capability
        if peer == agent.peer_id or cap is None or peer not in live:
            continue
        speeds = {s.sha256: s.tokens_per_s for s in cap.speeds}
        for held in cap.models:
            row = table.setdefault((held.name, held.sha256.hex()), {
                "name": held.name, "sha256": held.sha256.hex(), "providers": 0, "training": 0, "tokens_per_s": []})
            row["providers"] += 1
            row["training"] += int(cap.accepts_training)
            if held.sha256 in speeds:
                row["tokens_per_s"].append(speeds[held.sha256])
    return [table[k] for k in sorted(table)]


def trainers(agent: "Agent", terms: m.JobTerms) -> tuple[list[str], str]:
    """The live peers (ourselves included) whose signed capability lets a coordinator lease them a shard
    of the job (protocol/fit.lease_refusals), and, when there are none, one line saying why. None either
    when no other peer could coordinate it: the only trainer would be elected and train nothing (a lone
    worker with a submitter that does not coordinate sat ANNOUNCED)."""
    from collections import Counter

    from protocol.fit import lease_refusals

    live = set(agent.live_peers())
    caps = {peer: info.capability for peer, info in agent.peers.items() if peer in live}
    caps[agent.peer_id] = agent.capabilities.capability()
    able, why = [], Counter()
    for peer, cap in sorted(caps.items()):
        reasons = lease_refusals(cap, terms)
        if not reasons:
            able.append(peer)
        else:
            why[reasons[0]] += 1
    if able:
        # a coordinator leases nothing to itself (protocol/leasing.py rule 1): another must be able to coordinate
        coordinators = agent.eligible_coordinators(terms)
        if any(c != t for c in coordinators for t in able):
            return able, ""
        if not coordinators:
            return [], (f"no live peer can coordinate it ({len(caps)} known, this agent included): a coordinator "
                        f"must hold {terms.base_model} and have can_coordinate = true; it waits for one")
        return [], (f"the only peer that can train it (…{able[0][-8:]}) is also the only one that can coordinate "
                    "it, and a coordinator trains nothing of its own job: nobody would train it; start another "
                    f"agent that holds {terms.base_model} (a worker, or one with can_coordinate = true)")
    detail = "; ".join(f"{n} peer{'s' if n != 1 else ''}: {reason}" for reason, n in why.most_common(3))
    return [], (f"no live peer can train it ({len(caps)} known, this agent included): {detail}; it waits for one "
                f"that holds {terms.base_model} (sha256 {terms.base_model_sha256.hex()[:16]}…) and accepts training")


def speeds_for(agent: "Agent", sha256: bytes, providers_only: tuple[str, ...] = ()) -> list[float]:
    """Advertised tokens/s of the live training peers holding the model (restricted to ``providers_only``)."""
    live, out = agent.live_peers(), []
    for peer, info in agent.peers.items():
        cap = info.capability
        if cap is None or peer not in live or not cap.accepts_training or \
                (providers_only and peer not in providers_only):
            continue
        out += [s.tokens_per_s for s in cap.speeds if s.sha256 == sha256]
    return out


# -- estimates ----------------------------------------------------------------------------------------

DPO_COST = 4 / 3  # a DPO pair's tokens as training work: the reference pass is a forward without backward (~1/3)


def count_tokens(spec: Any, plan: Any, model_path: str) -> dict:
    """Tokenize the job's training shards (``plan``: agent/roles/submitter.ShardPlan) with the model's tokenizer:
    tokens, steps and tokens per step."""
    from agent.train.config import TrainConfig
    from agent.train.data import pack, tokenize
    from agent.train.model import load_tokenizer
    from agent.train.preference import tokenize_pairs

    records, split = plan.records, plan.split
    tokenizer = load_tokenizer(model_path)
    config = TrainConfig.from_spec(spec)
    shard_tokens, shard_steps, per_step = [], [], []
    for indices in split.shards:
        if spec.type == "dpo":  # a pair is both sides, and the reference's forward pass (no backward): ~4/3
            pairs, _ = tokenize_pairs(tokenizer, [records[i] for i in indices], spec.training.max_seq_len)
            examples, lengths = pairs, [round(p.n_tokens * DPO_COST) for p in pairs] or [0]
        else:
            examples, _ = tokenize(tokenizer, [records[i] for i in indices], spec.training.max_seq_len)
            if spec.training.packing:  # what the worker trains: fewer, longer sequences (training.packing)
                examples = pack(examples, spec.training.max_seq_len)
            lengths = [len(e.input_ids) for e in examples] or [0]
        shard_tokens.append(sum(lengths))
        shard_steps.append(config.total_steps(len(examples)))  # a round after the first ones (from_spec: max_steps)
        per_step.append(sum(lengths) / len(lengths) * config.samples_per_step)
    return {"shard_tokens": shard_tokens, "shard_steps": shard_steps, "tokens_per_step": per_step,
            "records": len(records)}


async def estimate(agent: "Agent", spec: Any, dataset: Path, model_path: str, *, max_nodes: int = 0,
                   providers_only: tuple[str, ...] = ()) -> dict:
    from agent.train.runner import run_torch
    from agent.train import base_model_sha256

    plan = await trio.to_thread.run_sync(partial(agent.submitter.shard_plan, spec, dataset, keep=True))  # for the announce
    counted = await trio.to_thread.run_sync(run_torch, count_tokens, spec, plan, model_path)
    digest = bytes.fromhex(await trio.to_thread.run_sync(base_model_sha256, model_path))
    result = mk.estimate(shard_tokens=counted["shard_tokens"], shard_steps=counted["shard_steps"],
                         tokens_per_step=counted["tokens_per_step"], rounds=spec.rounds,
                         first_round_steps=spec.training.first_round_steps,
                         speeds=speeds_for(agent, digest, providers_only), price_per_hour=spec.budget.price_per_hour,
                         budget=spec.budget.total, max_nodes=max_nodes)
    out = {"name": spec.name, "base_model": spec.base_model, "base_model_sha256": digest.hex(),
           "records": counted["records"], "shards": spec.shards, "rounds": spec.rounds, **result.to_json()}
    limit = float(spec.resources.max_runtime_hours)
    out["max_runtime_hours"] = limit
    # a job whose training alone outlasts its own deadline fails there (issue 25: 3.4 years vs 24 h, unsaid)
    out["over_runtime"] = out.get("wall_hours") is not None and out["wall_hours"] > limit
    return out


def _duration(hours: float) -> str:
    seconds = hours * 3600
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.1f} s"


def estimate_text(e: dict) -> str:
    lines = [f"estimate for {e['name']}: {e['records']} records, {e['shards']} shards x {e['rounds']} rounds",
             f"  tokens:        {e['tokens']:,} in the training shards; {e['tokens_trained']:,} trained in all "
             f"({e['steps']:,} optimizer steps)"]
    if e["tokens_per_s"] is None:
        lines.append(f"  speed:         no live provider advertises a measured speed for {e['base_model']} "
                     "(hours and cost unknown)")
    else:
        lines.append(f"  speed:         {e['tokens_per_s']:,.0f} tokens/s (median of {e['providers']} provider"
                     f"{'s' if e['providers'] != 1 else ''} measured speeds)")
        workers = min(e["providers"], e["shards"])
        lines.append(f"  worker-hours:  {e['worker_hours']:.6f} ({_duration(e['worker_hours'])} of training; about "
                     f"{_duration(e['wall_hours'])} of wall time on {workers} worker{'s' if workers != 1 else ''})")
        if e.get("over_runtime"):
            lines.append(f"  runtime:       OVER ITS LIMIT: about {_duration(e['wall_hours'])} of wall time, "
                         f"resources.max_runtime_hours is {e['max_runtime_hours']:g}: the job would fail at its "
                         "deadline (train fewer steps or rounds, or raise the limit)")
    if e["price_per_hour"] > 0:
        cost = "unknown" if e["cost"] is None else f"{e['cost']:.4f}"
        lines.append(f"  cost:          {cost} at {e['price_per_hour']:g}/h; budget.total {e['budget']:g}"
                     + (" — OVER BUDGET: leasing stops when the budget is spent" if e["over_budget"] else ""))
    else:
        lines.append("  cost:          0 (a volunteer job: budget.price_per_hour is 0)")
    return "\n".join(lines)


# -- bills --------------------------------------------------------------------------------------------

def bill(agent: "Agent", view: "JobMirror") -> dict:
    """The job's bill, signed by this agent (the submitter), appended to the ledger, checked against it."""
    from protocol.identity import verify_signature

    terms = view.terms
    if terms.submitter != agent.peer_id:
        raise ValueError(f"job {view.job_id.hex()[:16]} was submitted by {terms.submitter}, not this agent; "
                         "only its submitter bills it")
    attempts = accepted_attempts(view)
    doc = mk.make_bill(view.job_id, terms.submitter, terms.price_per_hour, terms.budget, attempts, agent.clock())
    signed = mk.bill_bytes(doc)
    signature = agent.identity.sign(signed)
    assert verify_signature(agent.identity.public_key, signed, signature)
    digest = mk.bill_hash(doc)
    entry = {"bill_sha256": digest, "total": doc["total"], "hours": doc["hours"],
             "workers": {row["worker"]: row["amount"] for row in doc["workers"]}}
    last = [e for e in agent.store.ledger(view.job_id) if e.kind == "bill"]
    if not last or last[-1].data.get("total") != doc["total"] or last[-1].data.get("workers") != entry["workers"]:
        agent.ledger(view.job_id, "bill", entry)  # a new bill only when the amounts changed
    from agent.jsonable import plain

    out = plain(doc)
    out.update(state=view.state.phase.value, signature=signature.hex(), signer=agent.peer_id,
               bill_sha256=digest.hex(), ledger=ledger_check(agent, view, doc))
    return out


def ledger_check(agent: "Agent", view: "JobMirror", doc: dict) -> dict:
    """Compare the bill with the ``report`` and ``verdict`` entries of every ledger chain of the job this
    agent holds: its own and its copies of the others' (IPIP-0008 §5; the workers write the reports,
    the coordinators the verdicts, so a submitter that does not coordinate holds them only as copies:
    ``job bill`` pulls them first). A verdict entry counts only when its author signed the Verdict our
    mirror applied for that attempt (``verdict_signers``). The rule: protocol/market.compare_bill_with_ledger."""
    from agent.ledger_sync import readable_chains

    chains, bad = readable_chains(agent.store, view.job_id)
    out = mk.compare_bill_with_ledger(doc, [e for chain in chains.values() for e in chain], verdict_signers(agent, view))
    out["chains"] = len(chains)
    out["problems"] += [f"a ledger chain we hold does not verify, not used: {problem}" for problem in bad.values()]
    out["consistent"] = not out["problems"]
    return out


def verdict_signers(agent: "Agent", view: "JobMirror") -> dict[tuple, str]:
    """(round, shard, attempt) -> the peer that signed the Verdict our mirror applied for it: the
    stored verdict envelope (the store keeps the envelopes that changed the mirror) whose message is
    the view's verdict for that attempt."""
    out = {}
    for stored in agent.store.verdicts(view.job_id):
        msg = stored.message
        key = m.attempt_of(msg)
        if view.verdicts.get(key) == msg:
            out[key] = stored.signer
    return out


def bill_text(b: dict) -> str:
    lines = [f"bill for job {b['job_id'][:16]} ({b['state']}), price {b['price_per_hour']:g}/h, budget {b['budget']:g}",
             f"{'worker':<20} {'accepted':>8} {'rejected':>8} {'hours':>10} {'amount':>12}"]
    for row in b["workers"]:
        lines.append(f"{'…' + row['worker'][-18:]:<20} {row['accepted']:>8} {row['rejected']:>8} "
                     f"{row['hours']:>10.6f} {row['amount']:>12.6f}")
    lines.append(f"{'total':<20} {'':>8} {'':>8} {b['hours']:>10.6f} {b['total']:>12.6f}")
    ledger = b["ledger"]
    lines.append(f"signed by {b['signer']} (bill sha256 {b['bill_sha256'][:16]}…); ledger: "
                 + (f"consistent ({ledger['entries_checked']} billed attempts checked against "
                    f"{ledger.get('chains', 0)} chains)" if ledger["consistent"]
                    else "INCONSISTENT: " + "; ".join(ledger["problems"][:3]))
                 + (f"; {len(ledger['ignored'])} verdict entries by others than the judge not counted"
                    if ledger.get("ignored") else ""))
    return "\n".join(lines)
