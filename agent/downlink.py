"""Coded aggregates on disk and over the network (IPIP-0006 §2.8.1; which rounds, and what an update holds:
protocol/downlink.py).

A round's aggregate is most of what every worker of the next round fetches at its start: on the demo 1.31 MB
(the adapter and its averaged AdamW state, float32), where an ``int4-fresh`` report is 138 KB; for a 7B rank-16
adapter, ~330 MB over each worker's downlink and, at once, the coordinator's uplink. With the job's
``aggregate_codec`` the coordinator codes the round's combined state from the round's start as a report's end
state is coded, publishes the decoded state as the aggregate, and serves the payload beside it (the update); a
peer holding the round's start fetches the update and rebuilds the aggregate's bundle bit for bit.

Rules of this file:
- One function writes a coded aggregate's files, ``rebuild``: the coordinator writes its aggregate through it
  from the update it serves, and a holder rebuilds through it, so both write the same bytes (the same
  decode, the same safetensors writer, the update's config and outer state copied as they are).
- The rebuilt bundle is trusted only when its CID is the announced aggregate's (``fetch_coded``); anything
  else (no start held here, a fetch or decode failing, another CID) returns False, and the caller fetches
  the aggregate whole. Nothing is half-written: the bundle is written next to ``out`` and renamed into place.
- The update is untrusted bytes: a bounded fetch, a checked unpack (``UPDATE_FILES`` only), a decode that
  checks every key, dtype and length (agent/train/codec.py).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import trio

from agent.bundle import AGGREGATE_FILES, DEFAULT_MAX_BYTES as MAX_BUNDLE, bundle_size_bound, pack_dir_off_loop, \
    unpack_off_loop
from protocol.downlink import UPDATE_FILES

if TYPE_CHECKING:
    from agent.content.service import ContentService
    from protocol.messages import JobTerms

log = logging.getLogger(__name__)



def code_aggregate(terms: "JobTerms", out: Path, update: Path, start: dict, start_optimizer: dict | None) -> None:
    """(Torch, in a thread.) The combined state in aggregate directory ``out`` becomes the coded aggregate: start +
    decode(encode(combined - start)); the update's files (payload, config, outer state) are written to ``update``."""
    from safetensors.torch import load_file

    from agent.train.aggregate import OPTIMIZER_FILE, OUTER_STATE_FILE, frozen_keys
    from agent.train.codec import PAYLOAD_FILE, encode, save_payload

    codec = terms.training.aggregate_codec
    carried = terms.training.optimizer_state == "carried"
    combined = load_file(str(out / "adapter_model.safetensors"))
    optimizer = load_file(str(out / OPTIMIZER_FILE)) if carried else {}
    payload = encode(start, combined, optimizer, frozen_keys(start, terms.lora.freeze_a), codec,
                     start_optimizer if carried else None)
    shutil.rmtree(update, ignore_errors=True)
    update.mkdir(parents=True)
    save_payload(update / PAYLOAD_FILE, payload, codec, kind="update")
    for name in ("adapter_config.json", OUTER_STATE_FILE):
        if (out / name).exists():
            shutil.copyfile(out / name, update / name)
    rebuild(terms, update, start, start_optimizer, out)


def rebuild(terms: "JobTerms", update: Path, start: dict, start_optimizer: dict | None, out: Path) -> None:
    """(Torch, in a thread.) The coded aggregate's files in ``out`` from update directory ``update`` and the round's
    start (adapter tensors, AdamW state): CodecError (naming the tensor) when the update does not decode onto it."""
    from safetensors.torch import save_file

    from agent.train.aggregate import OPTIMIZER_FILE, OUTER_STATE_FILE, frozen_keys
    from agent.train.codec import PAYLOAD_FILE, CodecError, decode, load_payload

    codec = terms.training.aggregate_codec
    carried = terms.training.optimizer_state == "carried"
    if not (update / "adapter_config.json").exists():
        raise CodecError("adapter_config.json: missing from the update")
    payload = load_payload(update / PAYLOAD_FILE, codec, kind="update")
    adapter, optimizer = decode(payload, start, None, frozen_keys(start, terms.lora.freeze_a), codec,
                                start_optimizer if carried else None)
    if optimizer and not carried:
        raise CodecError("optimizer: the job does not carry the AdamW state, but the update has one")
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    if optimizer:
        save_file(optimizer, str(out / OPTIMIZER_FILE), metadata={"format": "pt"})
    for name in ("adapter_config.json", OUTER_STATE_FILE):
        if (update / name).exists():
            shutil.copyfile(update / name, out / name)
        else:
            (out / name).unlink(missing_ok=True)


def read_start(terms: "JobTerms", directory: Path) -> tuple[dict, dict, dict]:
    """(In a thread.) A round's start from the previous round's aggregate in ``directory``: its adapter, its outer
    optimizer state (empty without one) and the AdamW state the job carries (empty when it does not; ValueError when
    it does and the aggregate lacks it). The coordinator, a rebuilding holder and a combining worker read it here."""
    from safetensors.torch import load_file

    from agent.train.aggregate import OPTIMIZER_FILE, OUTER_STATE_FILE

    adapter = load_file(str(directory / "adapter_model.safetensors"))
    state = load_file(str(directory / OUTER_STATE_FILE)) if (directory / OUTER_STATE_FILE).exists() else {}
    if terms.training.optimizer_state != "carried":
        return adapter, state, {}
    if not (directory / OPTIMIZER_FILE).exists():
        raise ValueError(f"the round's start carries no {OPTIMIZER_FILE}")
    return adapter, state, load_file(str(directory / OPTIMIZER_FILE))


def _rebuild_from(terms: "JobTerms", update: Path, start_dir: Path, out: Path) -> None:
    adapter, _, optimizer = read_start(terms, start_dir)
    rebuild(terms, update, adapter, optimizer, out)


async def fetch_coded(content: "ContentService", terms: "JobTerms", *, cid: str, update_cid: str, base_cid: str,
                      out: Path, providers: Sequence[str], swarm: Sequence[str] = (), timeout: float = 60.0,
                      work: Path) -> bool:
    """Hold aggregate ``cid`` as the bundle ``out`` by rebuilding it from its update ``update_cid`` (fetched from
    ``providers``, together with ``swarm``) onto the round's start ``base_cid``, held here; True once the rebuilt
    bundle's CID is ``cid`` (its blocks are then in the store, served as any). False, logged, otherwise: the
    caller fetches ``cid`` whole. ``work``: a scratch directory, removed after."""
    if await content.read_local(cid, out, max_size=bundle_size_bound(MAX_BUNDLE, AGGREGATE_FILES)):
        return True  # held already
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    began = trio.current_time()
    try:
        if not await content.read_local(base_cid, work / "start.tar",
                                        max_size=bundle_size_bound(MAX_BUNDLE, AGGREGATE_FILES)):
            log.info("aggregate %s…: the round's start %s… is not held here; fetching it whole", cid[:24], base_cid[:24])
            return False
        try:
            await content.fetch(update_cid, work / "update.tar", timeout=timeout, providers=providers, swarm=swarm,
                                max_size=bundle_size_bound(MAX_BUNDLE, UPDATE_FILES))
            start = await unpack_off_loop(work / "start.tar", work / "start", allowed=AGGREGATE_FILES,
                                          max_bytes=MAX_BUNDLE)
            update = await unpack_off_loop(work / "update.tar", work / "update", allowed=UPDATE_FILES,
                                           max_bytes=MAX_BUNDLE)
            # a plain thread, not run_torch: the decode needs torch alone, and run_torch's first call imports peft and
            # transformers (3 s of CPU in a submitter, which trains nothing, measured beside the round's training)
            await trio.to_thread.run_sync(_rebuild_from, terms, update, start, work / "aggregate")
            bundle = await pack_dir_off_loop(work / "aggregate", work / "aggregate.tar")
            rebuilt = str(await content.add_file(bundle, provide=False))
        except Exception as exc:  # noqa: BLE001 - any failure here costs the whole fetch, nothing else
            log.warning("aggregate %s…: not rebuilt from update %s…: %s: %s; fetching it whole", cid[:24],
                        update_cid[:24], type(exc).__name__, str(exc)[:300])
            return False
        if rebuilt != cid:
            log.warning("aggregate %s…: update %s… rebuilds %s… instead; fetching it whole", cid[:24],
                        update_cid[:24], rebuilt[:24])
            return False
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(bundle), str(out))
        log.info("aggregate %s…: rebuilt from update %s… (%d bytes for %d) in %.2f s", cid[:24], update_cid[:24],
                 (work / "update.tar").stat().st_size, out.stat().st_size, trio.current_time() - began)
        return True
    finally:
        shutil.rmtree(work, ignore_errors=True)

