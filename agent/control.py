"""The local control channel: the CLI talks to a running agent over a Unix socket in its home.

Rules of this file:
- Local only, never a network port: a Unix socket ``<home>/control.sock`` created with mode 0600
  (bound under a 0177 umask, then chmod), so only the agent's own user can connect. A socket file
  left by a dead agent is replaced; one that still answers means an agent already runs there.
- One request per connection: the client (agent/channel.py ``request``) sends one JSON object on one
  line, at most ``MAX_REQUEST`` bytes: ``{"cmd": NAME, "args": {...}}``; the daemon answers one line
  ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": ONE LINE}`` and closes. Reading the
  request has a deadline; each command has its own (fetching an adapter takes longer than a status).
- Handlers only read the agent's state or call its roles; they never decide protocol questions.
  A handler's failure is an error answer, never the daemon's death.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from agent import __version__
from agent.channel import ControlError, find_job

if TYPE_CHECKING:
    from agent.node import Agent

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
REQUEST_READ_TIMEOUT = 10.0
CAPABILITY_WAIT = 10.0  # seconds `job announce` waits to hear a peer that can train the job (a peer tells its
# capability to one it hears arrive: agent/node.py CAPABILITY_TELL_GAP)
BILL_SYNC_SECONDS = 15.0  # `job bill` pulls the job's ledger chains for at most this long (the CLI waits 30 s)
MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux, 104 on macOS


# -- the daemon's side -------------------------------------------------------------------------------

def bind_control_socket(path: Path) -> trio.SocketListener:
    """Bind and listen on ``path`` with mode 0600; ControlError if an agent already answers there."""
    if len(str(path)) > MAX_SOCKET_PATH:
        raise ControlError(f"{path}: the control socket path is too long for a Unix socket; use a shorter --home")
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # left by an agent that died
        else:
            raise ControlError(f"{path}: an agent is already running in {path.parent} (stop it first)")
        finally:
            probe.close()
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock._sock.bind(str(path))  # synchronous bind under the umask (trio's bind is async)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(16)
    return trio.SocketListener(sock)


async def serve_control(agent: "Agent", listener: trio.SocketListener) -> None:
    """Answer control requests until cancelled."""
    await trio.serve_listeners(lambda stream: _handle(agent, stream), [listener])


async def _handle(agent: "Agent", stream: trio.SocketStream) -> None:
    async with stream:
        try:
            with trio.fail_after(REQUEST_READ_TIMEOUT):
                raw = await _read_line(stream, MAX_REQUEST)
            request = json.loads(raw)
            if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
                raise ControlError('a request is {"cmd": NAME, "args": {...}}')
            args = request.get("args") or {}
            handler = HANDLERS.get(request["cmd"])
            if handler is None:
                raise ControlError(f"unknown command {request['cmd'][:40]!r}")
            if request["cmd"] != "stop":
                await agent.flush_writes()  # what the agent queued (ledger entries, job rows) is seen
            result = await handler(agent, **args)
            answer = {"ok": True, "result": result}
        except Exception as exc:  # noqa: BLE001 - every failure is an answer, never the daemon's end
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if not isinstance(exc, (ControlError, KeyError, ValueError)):
                log.info("control request failed: %s: %s", type(exc).__name__, message)
            answer = {"ok": False, "error": message}
        with trio.move_on_after(10):
            try:
                await stream.send_all(json.dumps(answer, default=str).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client left (a liveness probe connects and closes at once)


async def _read_line(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    data = bytearray()
    while b"\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ControlError(f"message larger than {limit} bytes")
    return bytes(data).split(b"\n", 1)[0]


# -- handlers ------------------------------------------------------------------------------------------

async def _status(agent: "Agent") -> dict:
    jobs: dict[str, int] = {}
    for record in agent.store.jobs():
        view = agent.jobs.get(record.job_id)
        state = view.state.phase.value if view else record.state
        jobs[state] = jobs.get(state, 0) + 1
    return {
        "peer_id": agent.peer_id, "version": __version__, "addrs": agent.addrs(), "home": str(agent.config.home),
        "pid": os.getpid(), "uptime_s": round(agent.clock() - agent.started_at, 1),
        "accept_training": agent.worker is not None, "can_coordinate": agent.config.can_coordinate,
        "peers": len(agent.live_peers()), "connected": len(agent.net.host.connected_peers()), "jobs": jobs,
        "active_shards": len(agent.worker.active) if agent.worker else 0, "counters": dict(agent.counters),
        "refusing_work": agent.store_full,  # None, or why (the store cannot be written: disk full)
        "reach": _reach(agent),
        "streams": agent.net.host.stream_report(),
        "disk": agent.disk.as_json(),  # the home's use at the last collection, the quota (agent/disk.py)
    }


def _reach(agent: "Agent") -> dict | None:
    """Reachability (AutoNAT), relay slots held and served, direct vs relayed connections."""
    from dataclasses import asdict

    if agent.net is None:
        return None
    return asdict(agent.net.host.reach.report())


async def _peers(agent: "Agent") -> list[dict]:
    now = agent.clock()
    live = agent.live_peers()
    out = []
    for peer, info in sorted(agent.peers.items()):
        if peer == agent.peer_id:
            continue
        cap = info.capability
        out.append({"peer_id": peer, "live": peer in live, "last_heartbeat_s": round(now - info.last_heartbeat, 1),
                    "accepts_training": cap.accepts_training if cap else None,
                    "can_coordinate": cap.can_coordinate if cap else None,
                    "price_per_hour": cap.price_per_hour if cap else None,
                    "version": cap.agent_version if cap else None,
                    **_hardware_fields(cap),
                    "active_shards": info.active_shards,
                    "max_concurrent_shards": cap.max_concurrent_shards if cap else None,
                    "busy": info.active_shards > 0})
    return out


def _hardware_fields(cap: Any) -> dict:
    """What a peer's signed capability says about its hardware and models (None: not heard yet)."""
    if cap is None:
        return {"device": None, "gpus": [], "vram_gb": None, "cpu": None, "runtimes": [], "models": []}
    return {"device": cap.hardware.device, "cpu": cap.cpu_model, "vram_gb": cap.hardware.vram_gb,
            "gpus": [{"kind": d.kind, "index": d.index, "name": d.name, "vram_total_gb": d.vram_total_gb,
                      "vram_free_gb": d.vram_free_gb, "compute_capability": d.compute_capability, "bf16": d.bf16}
                     for d in cap.devices],
            "runtimes": list(cap.backends), "models": [{"name": x.name, "sha256": x.sha256.hex()} for x in cap.models]}


async def _spec_inputs(agent: "Agent", spec: str, dataset: str | None) -> tuple[Any, Path, str, str | None]:
    """The job spec, its dataset file (fetched and checked when the spec names a CID), our local copy
    of its base model and the dataset's CID (None for a local file); ControlError naming what is missing."""
    from agent.files import FileInputError, input_file
    from protocol.jobspec import dataset_cid

    job_spec = agent.submitter.spec_of(spec)  # read once for an estimate and the announce after it
    cid = None if dataset or job_spec.input.hf else dataset_cid(job_spec.input.dataset)
    if cid is not None:  # data already in IPFS: fetched and checked against its CID, then sharded
        data = await agent.submitter.fetch_dataset(cid)
    elif job_spec.input.hf and not dataset:  # a Hugging Face dataset: converted to ChatML here, once
        from agent.hfdata import HubDataError, spec_dataset

        try:
            data = await trio.to_thread.run_sync(spec_dataset, job_spec.input, agent.work_dir / "datasets")
        except HubDataError as exc:
            raise ControlError(f"input.hf {exc}") from None
    else:
        data = Path(dataset) if dataset else (Path(spec).parent / job_spec.input.dataset)
    try:
        input_file(data, "dataset", " (give --dataset FILE or set input.dataset in the spec)")
    except FileInputError as exc:
        raise ControlError(str(exc)) from None
    model = dict(agent.config.models).get(job_spec.base_model) or job_spec.base_model
    if not Path(model).is_dir():
        raise ControlError(f"base model {job_spec.base_model!r}: not a local directory and not in [models] "
                           f"of {agent.config.home / 'config.toml'}")
    return job_spec, data, model, cid


def _market_args(max_nodes: int | None, providers: list[str] | None) -> tuple[int, tuple[str, ...]]:
    from protocol.identity import public_key_from_peer_id

    if max_nodes is not None and not 1 <= max_nodes <= 1024:
        raise ControlError(f"--max-nodes: must be between 1 and 1024, got {max_nodes}")
    for peer in providers or ():
        try:
            public_key_from_peer_id(peer)
        except Exception:  # noqa: BLE001 - KeyFileError and friends: one line
            raise ControlError(f"--provider {peer[:60]!r}: not a peer ID (see `infernet providers`)") from None
    if providers and len(set(providers)) > 64:
        raise ControlError("--provider: at most 64 providers")
    return max_nodes or 0, tuple(dict.fromkeys(providers or ()))


async def _job_announce(agent: "Agent", spec: str, dataset: str | None = None, max_nodes: int | None = None,
                        providers: list[str] | None = None, wait: bool = False) -> dict:
    nodes, named = _market_args(max_nodes, providers)
    agent.submitter.check_room()  # past the limit of live jobs: refused before the dataset is sharded
    job_spec, data, model, cid = await _spec_inputs(agent, spec, dataset)
    terms = await agent.submitter.prepare_terms(job_spec, data, model, dataset_cid=cid, max_nodes=nodes,
                                                providers=named)
    from agent.market import trainers

    able, why = trainers(agent, terms)
    if not able and not wait:  # a submitter just started or restarted may not have heard them yet
        await agent.wait_until(lambda: bool(trainers(agent, terms)[0]), CAPABILITY_WAIT)
        able, why = trainers(agent, terms)
    if not able and not wait:  # it would sit ANNOUNCED with nobody to train it (issue 25)
        raise ControlError(f"not announced: {why}; start such a worker, or announce with --wait to let the "
                           "job wait for one (until its max_runtime_hours)")
    view = await agent.submitter.announce(terms)
    out = job_summary(agent, view)
    out["waiting"] = why or None
    return out


async def _job_estimate(agent: "Agent", spec: str, dataset: str | None = None, max_nodes: int | None = None,
                        providers: list[str] | None = None) -> dict:
    from agent.market import estimate

    nodes, named = _market_args(max_nodes, providers)
    job_spec, data, model, _ = await _spec_inputs(agent, spec, dataset)
    return await estimate(agent, job_spec, data, model, max_nodes=nodes, providers_only=named)


async def _job_bill(agent: "Agent", job: str) -> dict:
    from agent.market import bill

    view = await find_job(agent, job)
    if view.terms.submitter != agent.peer_id:
        raise ControlError(f"job {view.job_id.hex()[:16]} was submitted by {view.terms.submitter}, not this agent; "
                           "only its submitter bills it")
    from agent.ledger_sync import sync_job

    # the reports and verdicts the bill is checked against are in the workers' and coordinators' chains:
    # pull our copies up to date first (best effort, bounded: the check names what is still missing)
    with trio.move_on_after(BILL_SYNC_SECONDS):
        await sync_job(agent, view, timeout=BILL_SYNC_SECONDS / 2)
    await agent.flush_writes()  # the bill reads our chain: its last bill, the verdicts we queued meanwhile
    return bill(agent, view)


async def _providers(agent: "Agent") -> list[dict]:
    from agent.market import providers

    return providers(agent)


async def _models(agent: "Agent") -> list[dict]:
    from agent.market import models

    return models(agent)


async def _job_list(agent: "Agent") -> list[dict]:
    out = []
    for record in agent.store.jobs():
        view = agent.jobs.get(record.job_id)
        if view is not None:
            out.append(job_summary(agent, view, record.role))
        else:
            out.append({"id": record.job_id.hex(), "name": record.terms.name, "role": record.role,
                        "state": record.state, "round": record.round, "rounds": record.terms.rounds,
                        "shards": len(record.terms.shards), "accepted": None, "coordinator": None,
                        "term": record.coordinator_term, "published": [], "reason": ""})
    return out


async def _job_show(agent: "Agent", job: str) -> dict:
    return job_detail(agent, await find_job(agent, job))


async def _job_cancel(agent: "Agent", job: str, reason: str = "cancelled by the submitter") -> dict:
    view = await find_job(agent, job)
    if view.terms.submitter != agent.peer_id:
        raise ControlError(f"job {view.job_id.hex()[:16]} was submitted by {view.terms.submitter}, not this agent; "
                           "only its submitter can cancel it")
    if view.state.terminal:
        raise ControlError(f"job {view.job_id.hex()[:16]} already ended ({view.state.phase.value})")
    await agent.submitter.cancel(view, reason)
    return job_summary(agent, view)


async def _job_fetch(agent: "Agent", job: str, out: str, round: int | None = None) -> dict:
    from agent.bundle import AGGREGATE_FILES, bundle_size_bound

    view = await find_job(agent, job)
    if not view.aggregates:
        raise ControlError(f"job {view.job_id.hex()[:16]} has no published aggregate yet "
                           f"({view.state.phase.value}, round {view.state.round}); try again when it is DONE")
    rnd = round if round is not None else max(view.aggregates)
    if rnd not in view.aggregates:
        raise ControlError(f"job {view.job_id.hex()[:16]} has no aggregate for round {rnd} "
                           f"(published: {sorted(view.aggregates)})")
    published = view.aggregates[rnd]
    target = Path(out).expanduser().resolve()
    if target.exists() and any(target.iterdir()):
        raise ControlError(f"{target}: exists and is not empty; choose a new --out directory")
    bundle = agent.work_dir / view.job_id.hex()[:16] / f"fetched-r{rnd}.tar"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    providers = [p for p in (view.coordination.coordinator, view.terms.submitter) if p and p != agent.peer_id]
    await agent.content.fetch(published.adapter_cid, bundle, timeout=agent.config.fetch_timeout, providers=providers,
                              max_size=bundle_size_bound(4 << 30, AGGREGATE_FILES))
    from agent.sealing import open_bundle  # a private job's final aggregate is sealed to us (ipips/0010)

    from agent.bundle import bundle_limiter

    _, sealed = await trio.to_thread.run_sync(  # up to 4 GiB: off the event loop
        lambda: open_bundle(bundle, target, agent.identity, max_bytes=4 << 30), limiter=bundle_limiter())
    layout = "peft-adapter"
    if view.terms.method == "full":  # the weights as a model directory transformers loads (base files beside them)
        from agent.train.model import as_model_dir

        await trio.to_thread.run_sync(as_model_dir, target, agent.capabilities.local_model(view.terms))
        layout = "model"
    return {"id": view.job_id.hex(), "round": rnd, "final": published.final, "cid": published.adapter_cid,
            "sealed": sealed, "layout": layout,
            "path": str(target), "method": published.method, "shards": list(published.shards),
            "base_model": view.terms.base_model}


async def _stop(agent: "Agent") -> dict:
    agent.stop()
    return {"stopping": True}


HANDLERS = {
    "status": _status, "peers": _peers, "job.announce": _job_announce, "job.list": _job_list,
    "job.show": _job_show, "job.cancel": _job_cancel, "job.fetch": _job_fetch,
    "stop": _stop, "providers": _providers, "models": _models, "job.estimate": _job_estimate, "job.bill": _job_bill,
}


def _more_handlers() -> None:
    from agent.jobdata import HANDLERS as JOBDATA  # job.ledger (chains, export), data.get

    HANDLERS.update(JOBDATA)


_more_handlers()


# -- what a job looks like on the channel -------------------------------------------------------------

def job_summary(agent: "Agent", view: Any, role: str | None = None) -> dict:
    from protocol.state import ShardPhase

    terms, state = view.terms, view.state
    if role is None:
        record = agent.store.job(view.job_id)
        role = record.role if record else "observer"
    return {"id": view.job_id.hex(), "name": terms.name, "role": role, "state": state.phase.value,
            "round": state.round, "rounds": terms.rounds, "shards": len(terms.shards),
            "accepted": state.count(ShardPhase.ACCEPTED), "coordinator": view.coordination.coordinator,
            "term": view.coordination.term, "published": list(state.published), "reason": state.reason}


def job_detail(agent: "Agent", view: Any) -> dict:
    """The summary, plus each shard of the current round and each published aggregate."""
    out = job_summary(agent, view)
    shards = []
    for shard in view.state.shards:
        key = (view.state.round, shard.index, shard.attempt)
        commits = view.commits.get(key, [])
        report = view.reports.get(key)
        verdict = view.verdicts.get(key)
        last = commits[-1] if commits else None
        shards.append({
            "index": shard.index, "state": shard.phase.value, "attempt": shard.attempt, "worker": shard.worker,
            "expires_at": shard.expires_at, "step": report[0].steps if report else (last.step if last else 0),
            "loss": report[0].final_loss if report else (last.loss if last else None),
            "verdict": None if verdict is None else {"accepted": verdict.accepted, "reason": verdict.reason},
        })
    out["shard_states"] = shards
    # every attempt's committed checkpoint losses, by worker: the training curves (`job watch --logdir`)
    out["curves"] = []
    for key, commits in sorted(view.commits.items()):
        lease, verdict = view.leases.get(key), view.verdicts.get(key)
        out["curves"].append({"round": key[0], "shard": key[1], "attempt": key[2],
                              "worker": lease.worker if lease is not None else None,
                              "accepted": None if verdict is None else verdict.accepted,
                              "points": [[c.step, c.loss] for c in sorted(commits, key=lambda c: c.step)]})
    out["base_model"] = view.terms.base_model
    out["base_model_sha256"] = view.terms.base_model_sha256.hex()  # what `infernet publish` writes in the card
    out["dataset_cids"] = {f"shard-{ref.index}": ref.cid for ref in view.terms.shards}
    if view.terms.validation_cid:
        out["dataset_cids"]["validation"] = view.terms.validation_cid
    out["leases"] = len(view.leases)
    out["verdicts"] = {"accepted": sum(v.accepted for v in view.verdicts.values()),
                       "rejected": sum(not v.accepted for v in view.verdicts.values())}
    out["aggregates"] = [{"round": a.round, "cid": a.adapter_cid, "method": a.method, "shards": list(a.shards),
                          "samples": a.samples, "final": a.final, "validation_loss": a.validation_loss,
                          "base_validation_loss": a.base_validation_loss, "reward_accuracy": a.reward_accuracy,
                          "reward_margin": a.reward_margin}
                         for _, a in sorted(view.aggregates.items())]
    out["outer"] = view.terms.outer.optimizer if view.terms.outer else "none"
    out["type"] = view.terms.training.objective  # sft | dpo
    out["method"] = view.terms.method  # lora | qlora | full
    from agent.utilization import of_mirror

    out["utilization"] = of_mirror(view).as_json()  # how busy the job kept its workers (issue 24)
    from agent.market import budget_json

    out["budget"] = budget_json(view)  # paid jobs: spent so far, and why leasing stopped (IPIP-0004 §12)
    out["waiting"] = None  # why nothing happens: a job no live peer can train sat ANNOUNCED, unsaid (issue 25)
    if not view.state.terminal and view.open_shards():
        from agent.market import trainers

        out["waiting"] = trainers(agent, view.terms)[1] or None
    # accepted work our submitter role has no copy of yet (it keeps trying): empty when all is held
    out["not_held"] = [{k: v for k, v in item.items() if k != "provider"} for item in agent.submitter.not_held(view)]
    from agent.jobdata import job_facts  # created, model hash, shard CIDs, parameters, price, cost so far

    out.update(job_facts(agent, view))
    return out

