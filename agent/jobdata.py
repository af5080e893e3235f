"""A job's record and data, for the control channel and the CLI: the replicated ledger (export and
offline verification), datasets by CID, and the facts ``job show`` prints.

Rules of this file:
- Handlers (``HANDLERS``, merged into agent/control.py's) only read the agent's store and state or
  call its content service and agent/ledger_sync.py; they decide nothing. This file imports neither
  agent/control.py (which imports it) nor the CLI: the channel's shared half is agent/channel.py.
- ``infernet ledger verify FILE`` needs no agent: it reads the export file (IPIP-0008 §6) and checks it
  with protocol/ledger.verify_export; any problem is one line naming the entry's place, exit 1.
- Cost so far is the IPIP-0008 §2 rule over the report entries of every chain we hold, each
  (round, shard, attempt) counted once: ``duration / 3600 * price_per_hour``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.channel import ControlError, find_job, request
from agent.jsonable import plain

if TYPE_CHECKING:
    from agent.node import Agent

MAX_EXPORT_FILE = 256 << 20  # bytes of an export file ``ledger verify`` reads


# -- facts of a job ------------------------------------------------------------------------------------

def job_facts(agent: "Agent", view: Any) -> dict:
    """What ``job show`` adds to a job's detail: when and what was asked, at what price, what it cost."""
    from agent.market import spent

    terms = view.terms
    # counted from the chains' heads, nothing read or verified: `job watch` asks every second (the demo twice), and
    # reading every entry grew with the job (at 48 rounds a tenth of the submitter's event loop)
    held = agent.store.chain_heads(view.job_id)
    return {
        "created": terms.created,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(terms.created)),
        "description": terms.description,
        "private": terms.private,
        "model_sha256": terms.base_model_sha256.hex(),
        "dataset_cid": terms.dataset_cid,
        "validation_cid": terms.validation_cid,
        "shard_cids": [{"index": s.index, "cid": s.cid, "records": s.records, "size": s.size} for s in terms.shards],
        "parameters": {"method": terms.method, "runtime": terms.runtime, "seed": terms.seed, "rounds": terms.rounds,
                       "aggregation": terms.aggregation, "training": terms.training.to_wire(),
                       "lora": terms.lora.to_wire(), "proof": terms.proof.to_wire(),
                       "lease_seconds": terms.lease_seconds},
        "price_per_hour": terms.price_per_hour,
        "budget_total": terms.budget,
        "cost_so_far": round(spent(view), 9),  # accepted work at the job's price: what the bill charges
        "ledger": {"chains": len(held), "entries": sum(length for length, _ in held.values()),
                   "conflicts": len(agent.store.conflicts(view.job_id))},
    }


# -- control handlers ----------------------------------------------------------------------------------

async def _job_ledger(agent: "Agent", job: str, export: str | None = None, sync: bool = False) -> dict:
    """Our own chain of the job (entries, verified), every chain we hold, the conflicts found; with
    ``sync`` a pull from the job's live peers first; with ``export`` the export file written there."""
    from agent.ledger_sync import readable_chains, sync_job
    from protocol.codec import canonical_encode
    from protocol.ledger import export_document

    view = await find_job(agent, job)
    synced = await sync_job(agent, view) if sync else None
    if export:  # the file carries our signed statement of every chain it holds (IPIP-0008 §6.1)
        from agent.ledger_sync import write_heads

        if await write_heads(agent, view):
            await agent.flush_writes()
    entries = agent.store.ledger(view.job_id)
    problem = None
    try:
        agent.store.verify_ledger(view.job_id)
    except Exception as exc:  # noqa: BLE001 - LedgerError: reported, not raised
        problem = str(exc)
    from protocol.identity import peer_id_from_public_key

    chains, bad = readable_chains(agent.store, view.job_id)
    summary = [{"author": peer_id_from_public_key(author), "entries": len(chain), "head": chain[-1].hash.hex(),
                "problem": None} for author, chain in chains.items()]
    summary += [{"author": peer_id_from_public_key(author), "entries": None, "head": None, "problem": problem}
                for author, problem in bad.items()]
    conflicts = agent.store.conflicts(view.job_id)
    out = {"id": view.job_id.hex(), "verified": problem is None, "problem": problem, "length": len(entries),
           "entries": [{"seq": e.seq, "time": e.time, "peer": e.peer, "kind": e.kind, "signer": e.signer_peer_id,
                        "hash": e.hash.hex(), "data": plain(e.data)} for e in entries],
           "chains": summary, "conflicts": conflicts, "synced": synced}
    if export:
        if bad:
            raise ControlError(f"not exported: a chain we hold does not verify: {next(iter(bad.values()))}")
        target = Path(export)
        if target.exists():  # as `data get` and `job fetch` do: an existing file is never overwritten (issue 25)
            raise ControlError(f"{target}: already exists; choose a new --export file")
        document = export_document(view.job_id, canonical_encode(view.terms.to_wire()), chains, conflicts)
        _write_atomically(target, json.dumps(document, indent=1).encode() + b"\n")
        out["exported"] = {"path": str(target), "chains": len(chains),
                           "entries": sum(len(c) for c in chains.values())}
    return out


async def _data_get(agent: "Agent", cid: str, out: str, max_size: int | None = None) -> dict:
    """Fetch any CID through our content service into ``out`` (a new file): every block is checked."""
    from protocol.cid import parse_cid

    text = cid[len("ipfs://"):].rstrip("/") if cid.startswith("ipfs://") else cid
    root = parse_cid(text)  # CIDError: one line naming the CID
    target = Path(out)
    if target.exists():
        raise ControlError(f"{target}: already exists; choose a new --out file")
    started = time.monotonic()
    report = await agent.content.fetch(root, target, timeout=agent.config.fetch_timeout, max_size=max_size)
    return {"cid": str(root), "path": str(target), "size": target.stat().st_size,
            "fetched_blocks": report.fetched_blocks, "seconds": round(time.monotonic() - started, 3)}


HANDLERS = {"job.ledger": _job_ledger, "data.get": _data_get}


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# -- the CLI's side ------------------------------------------------------------------------------------

def verify_export_file(path: Path) -> Any:
    """Read and check an export file; protocol LedgerError / OSError / ValueError as one line naming the file."""
    from protocol.ledger import LedgerError, verify_export

    from agent.files import read_bounded

    data = read_bounded(path, MAX_EXPORT_FILE, "ledger export")  # a regular file, within the bound
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    try:
        return verify_export(document)
    except LedgerError as exc:
        exc.args = (f"{path}: {exc}",)
        raise


def cmd_job_ledger(args: Any, home: Path, emit: Any) -> int:
    """``infernet job ledger ID [--sync] [--export FILE]``: exit 1 if our chain does not verify or a
    conflict was found between the chains of the job."""
    export = str(args.export.expanduser().resolve()) if args.export else None
    ledger = request(home, "job.ledger", timeout=120 if args.sync else 30, job=args.id, export=export,
                     sync=bool(args.sync))
    lines = job_ledger_text(ledger)
    for chain in ledger["chains"]:
        lines.append(f"  chain of {chain['author'][-8:]}: {chain['entries']} entries"
                     + (f", INVALID: {chain['problem']}" if chain["problem"] else ""))
    for conflict in ledger["conflicts"]:
        lines.append(f"  CONFLICT {conflict['detail']}")
    if ledger.get("exported"):
        x = ledger["exported"]
        lines.append(f"exported {x['chains']} chains, {x['entries']} entries to {x['path']}")
    emit(args, ledger, "\n".join(lines))
    ok = ledger["verified"] and not ledger["conflicts"] and not any(c["problem"] for c in ledger["chains"])
    return 0 if ok else 1


def cmd_ledger_verify(args: Any, emit: Any) -> int:
    """``infernet ledger verify FILE``: no agent needed."""
    from agent.errors import UserError

    path = args.file.expanduser()
    try:
        result = verify_export_file(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    summary = {"file": str(path), "job_id": result.job_id.hex(), "name": result.job_name,
               "chains": {peer: len(entries) for peer, entries in result.chains.items()}, "entries": result.entries,
               "valid": True}
    lines = [f"ok: {path}: job {result.job_id.hex()[:16]}"
             + (f" ({result.job_name})" if result.job_name else "")
             + f", {len(result.chains)} chains, {result.entries} entries, every signature and link verified"]
    lines += [f"  {peer}: {n} entries" for peer, n in summary["chains"].items()]
    emit(args, summary, "\n".join(lines))
    return 0


def cmd_data_get(args: Any, home: Path, emit: Any) -> int:
    """``infernet data get CID --out FILE`` through the running agent."""
    result = request(home, "data.get", timeout=600, cid=args.cid, out=str(args.out.expanduser().resolve()),
                     max_size=args.max_size)
    emit(args, result, f"ok: {result['cid']} -> {result['path']} ({result['size']} bytes, verified)")
    return 0


def facts_text(job: dict) -> list[str]:
    """``job show``'s lines for the facts of ``job_facts`` (text output)."""
    if "created" not in job:
        return []
    p = job["parameters"]
    training = p["training"]
    kind = f"dpo (beta {training.get('dpo_beta', 0.1):g}) " if training.get("objective") == "dpo" else ""
    shape = "every weight" if p["method"] == "full" else f"rank {p['lora']['rank']}"
    lines = [f"created {job['created_utc']}  model sha256 {job['model_sha256'][:16]}…  "
             f"{kind}{p['method']}/{p['runtime']} seed {p['seed']}  {p['aggregation']}  lr {training['learning_rate']:g}"
             f"  {shape}  rounds {p['rounds']}"
             + ("  private (final aggregate sealed to the submitter)" if job["private"] else "")]
    if job["description"]:
        lines.append(f"description: {job['description'].splitlines()[0][:200]}")
    if job["dataset_cid"]:
        lines.append(f"dataset {job['dataset_cid']}")
    lines += [f"shard {s['index']}: {s['cid']} ({s['records']} records, {s['size']} bytes)" for s in job["shard_cids"]]
    lines.append(f"price {job['price_per_hour']:g}/h  budget {job['budget_total']:g}  cost so far {job['cost_so_far']:.6g}"
                 f"  ledger: {job['ledger']['chains']} chains, {job['ledger']['entries']} entries"
                 + (f", {job['ledger']['conflicts']} CONFLICTS" if job["ledger"]["conflicts"] else ""))
    return lines


def job_ledger_text(ledger: dict) -> list[str]:
    """``job ledger``'s lines for our own chain of the job: one per entry, then whether it verified."""
    lines = []
    for e in ledger["entries"]:
        data = ", ".join(f"{k}={_short(v)}" for k, v in e["data"].items() if k not in ("parameters",))
        lines.append(f"{e['seq']:>4} {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']:<11} "
                     f"{e['peer'][-8:]} {data}")
    lines.append(f"ledger of job {ledger['id'][:16]}: {ledger['length']} entries, "
                 + ("chain and signatures verified" if ledger["verified"] else f"INVALID: {ledger['problem']}"))
    return lines


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
