"""A round's aggregate from its reports: the coordinator's combine, and the same computed by a worker that holds
the round's start (IPIP-0006 §2.9.1).

A round's aggregate is a function of its accepted reports (their adapters and sample counts, in the order of the
round's shards) and the round's start alone (§2.6.1: a successor aggregates a round to the same CID). The
coordinator computes it through ``materialize_report`` (a coded report decoded onto the start) and
``compute_aggregate`` (the job's rule and its outer step, ``aggregate_adapters``; then
``agent/downlink.code_aggregate`` for a coded round).

``combine_here`` is a worker's copy of that computation. An early round's named workers trained the round
before it, so they hold its start and their own reports, and with coded reports (§2.8) the other reports are a
small part of the aggregate's bytes. A worker fetches them from their workers as they are reported, computes the
aggregate, and keeps it only if its CID is the one the coordinator announced. Otherwise (a report not fetched,
not decodable, another CID) it fetches the aggregate as before. So the CID check is the whole of the trust, as
for a rebuilt coded aggregate (agent/downlink.py).

Rules of this file:
- One function each writes a report's decoded files and a round's aggregate: the coordinator and a worker call
  the same ones, so both write the same bytes.
- Reports are untrusted bytes here too: bounded fetches, checked unpacks (``REPORT_FILES`` only), a decode that
  checks every key, dtype and length (agent/train/codec.py). Nothing is half-written: the bundle is written next
  to ``out`` and moved into place once its CID is the announced one.
"""

from __future__ import annotations

import json
import logging
import shutil
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import trio

from agent.bundle import AGGREGATE_FILES, DEFAULT_MAX_BYTES as MAX_BUNDLE, REPORT_FILES, bundle_size_bound, \
    pack_dir_off_loop, unpack_off_loop
from agent.downlink import code_aggregate, read_start
from agent.train.runner import run_torch
from protocol import downlink, messages as m

if TYPE_CHECKING:
    from agent.content.service import ContentService

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 1 << 30  # an unpacked report, at most (the coordinator's bound too)
COMBINE_TIMEOUT = 30.0  # seconds a worker spends on fetching a round's reports before it fetches the aggregate
LOCAL_COMBINE_MAX_SHARDS = 8
"""A worker computes a round's aggregate itself only for jobs of at most this many shards: with ``int4-fresh`` a
report is about a ninth of the aggregate (IPIP-0006 §2.8), so the other reports are then no more bytes than the
aggregate, and they come over their own workers' links instead of the coordinator's."""


def combines_here(terms: m.JobTerms) -> bool:
    """Whether a named worker of an early round computes its start itself (``combine_here``): coded reports, a
    job of at most LOCAL_COMBINE_MAX_SHARDS shards, not full fine-tuning (whose reports travel whole)."""
    return terms.training.report_codec != "none" and len(terms.shards) <= LOCAL_COMBINE_MAX_SHARDS and \
        terms.method != "full"


class Rejection(Exception):
    """A report failed verification; the message is the verdict's reason."""


def materialize_report(directory: Path, terms: m.JobTerms, start: dict, start_optimizer: dict | None = None) -> None:
    """With a ``report_codec`` (int8, int4, int4-log, int4-fresh; IPIP-0006 §2.8): decode the report's payload onto the round's
    ``start`` and write the adapter (and AdamW state) files the rest of verification and aggregation
    read; the decoded state is then checked against the chain like a whole report. A coded job's
    report must carry the payload and no whole tensors, an uncoded one no payload: else Rejection.
    ``start_optimizer``: the round's start AdamW state (``int4-fresh`` codes what a round added to it)."""
    from agent.train.aggregate import OPTIMIZER_FILE, frozen_keys
    from agent.train.codec import PAYLOAD_FILE, CodecError, decode, load_payload
    from safetensors.torch import save_file

    coded = terms.training.report_codec != "none"
    present = {path.name for path in directory.iterdir()}
    if not coded:
        if PAYLOAD_FILE in present:
            raise Rejection(f"the job sends whole reports, but the report has {PAYLOAD_FILE}")
        return
    whole = present & {"adapter_model.safetensors", OPTIMIZER_FILE}
    if whole or PAYLOAD_FILE not in present:
        raise Rejection(f"the job's reports are coded ({terms.training.report_codec}): expected {PAYLOAD_FILE} "
                        f"and no {', '.join(sorted(whole)) or 'whole tensors'}")
    try:
        codec = terms.training.report_codec
        payload = load_payload(directory / PAYLOAD_FILE, codec)
        adapter, optimizer = decode(payload, start, None, frozen_keys(start, terms.lora.freeze_a), codec,
                                    start_optimizer if terms.training.optimizer_state == "carried" else None)
    except CodecError as error:
        raise Rejection(f"report payload: {error}") from None
    if terms.training.optimizer_state != "carried" and optimizer:
        raise Rejection("report payload: the job does not carry the optimizer state, but the payload has one")
    save_file(adapter, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    if optimizer:
        save_file(optimizer, str(directory / OPTIMIZER_FILE), metadata={"format": "pt"})


def aggregate_adapters(terms: m.JobTerms, inputs: list[tuple[Path, int]], out: Path, rnd: int,
                       start: tuple[dict, dict] | None, parallel: bool = True) -> None:
    """The round's aggregate into ``out``: the job's rule, then its outer step from ``start`` (if any). ``parallel``
    False: no process-wide torch setting changes meanwhile (agent/train/aggregate.aggregate), the same bytes."""
    from safetensors.torch import load_file, save_file

    from agent.train.aggregate import (
        OPTIMIZER_FILE, OUTER_STATE_FILE, OuterOptimizer, aggregate, average_optimizer_states, frozen_keys, outer_step,
    )

    pairs = [(load_file(str(d / "adapter_model.safetensors")), n) for d, n in inputs]
    merged = aggregate(terms.aggregation, pairs, parallel=parallel)
    out.mkdir(parents=True, exist_ok=True)
    if terms.training.optimizer_state == "carried":
        optimizers = [(load_file(str(d / OPTIMIZER_FILE)), n) for d, n in inputs]
        save_file(average_optimizer_states(optimizers), str(out / OPTIMIZER_FILE), metadata={"format": "pt"})
    if terms.outer is not None and start is not None:
        previous, state, _ = start
        o = terms.outer
        outer = OuterOptimizer(o.optimizer, o.lr, o.momentum, o.beta1, o.beta2)
        merged, state = outer_step(previous, merged, state, outer, step=rnd,
                                   frozen=frozen_keys(previous, terms.lora.freeze_a))
        if state:
            save_file(state, str(out / OUTER_STATE_FILE), metadata={"format": "pt"})  # one key: safetensors writes several in varying order
    save_file(merged, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    write_canonical_config(inputs[0][0] / "adapter_config.json", out / "adapter_config.json")


def reads_start(terms: m.JobTerms, rnd: int) -> bool:
    """Does round ``rnd``'s aggregate read the round's start (``compute_aggregate``)? For the outer step, and for a
    coded round's update (IPIP-0006 §2.4, §2.8.1)."""
    return terms.outer is not None or downlink.coded(terms, rnd)


def compute_aggregate(terms: m.JobTerms, inputs: list[tuple[Path, int]], out: Path, update: Path, rnd: int,
                      start: tuple[dict, dict, dict] | None, parallel: bool = True) -> None:
    """(Torch, in a thread.) Round ``rnd``'s aggregate of ``inputs`` into ``out``, and for a coded round its update into
    ``update`` (the aggregate is then the state the update decodes to, IPIP-0006 §2.8.1). ``start``: the round's
    start when ``reads_start``, else None. The coordinator and a combining worker both call this one."""
    aggregate_adapters(terms, inputs, out, rnd, start if reads_start(terms, rnd) else None, parallel=parallel)
    if downlink.coded(terms, rnd):
        adapter, _, optimizer = start
        code_aggregate(terms, out, update, adapter, optimizer)


def write_canonical_config(source: Path, target: Path) -> None:
    """The aggregate's ``adapter_config.json``: the first input's, with sorted keys and target modules.
    peft writes target_modules from a set, in an order that differs from process to process (string
    hashing), so copying one worker's file made the aggregate's CID depend on which worker trained the
    first shard: the same round aggregated by two coordinators, or one job run twice, gave two CIDs for
    the same tensors. Canonical, a round's aggregate is a function of its accepted inputs alone."""
    config = json.loads(source.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


async def start_here(content: "ContentService", terms: m.JobTerms, rnd: int, previous_cid: str | None, config: object,
                     work: Path) -> tuple[dict, dict, dict] | None:
    """Round ``rnd``'s start as the coordinator reads it (adapter, outer state, AdamW state carried): the seeded adapter
    (``config``: the job's TrainConfig, from the model pool) in round 1; else round ``rnd`` - 1's aggregate
    ``previous_cid``, from the blocks held here. None when it is not held here."""
    from agent.train.replay import expected_initial_adapter

    if rnd == 1:
        return await trio.to_thread.run_sync(run_torch, expected_initial_adapter, config), {}, {}
    if previous_cid is None or not await content.read_local(previous_cid, work / "start.tar",
                                                            max_size=bundle_size_bound(MAX_BUNDLE, AGGREGATE_FILES)):
        return None
    directory = await unpack_off_loop(work / "start.tar", work / "start", allowed=AGGREGATE_FILES, max_bytes=MAX_BUNDLE)
    return await trio.to_thread.run_sync(read_start, terms, directory)


async def combine_here(content: "ContentService", terms: m.JobTerms, *, rnd: int, cid: str,
                       reports: Sequence[tuple[str, str, int]], start: tuple[dict, dict, dict], out: Path, work: Path,
                       coordinator: str | None, timeout: float) -> bool:
    """Hold round ``rnd``'s announced aggregate ``cid`` as the bundle ``out`` by computing it here from the round's
    ``reports`` ((adapter CID, its worker, samples) in the order of the round's shards) and the round's ``start``
    (adapter, outer state, AdamW state), as the coordinator computes it; True once the bundle's CID is ``cid`` (its
    blocks are then in the store, served as any). False, logged, otherwise: the caller fetches ``cid``. A report not
    held here is fetched from its worker, else from the ``coordinator`` (which fetched every report it announced the
    aggregate of), all within ``timeout`` seconds. ``work``: a scratch directory, removed after. A bundle computed
    ahead (``combine_ahead``) is held already: then nothing is computed."""
    if await content.read_local(cid, out, max_size=bundle_size_bound(MAX_BUNDLE, AGGREGATE_FILES)):
        return True  # held already
    began = trio.current_time()
    try:
        computed = await _combined(content, terms, rnd=rnd, reports=reports, start=start, work=work,
                                   coordinator=coordinator, timeout=timeout)
        if computed is None:
            log.info("aggregate %s…: not computed here; fetching it", cid[:24])
            return False
        bundle, computed_cid, fetching = computed
        if computed_cid != cid:
            log.warning("aggregate %s…: the round's reports combine here to %s… instead; fetching it", cid[:24],
                        computed_cid[:24])
            return False
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(bundle), str(out))
        log.info("aggregate %s…: computed here from the round's %d reports in %.2f s (%.2f s of it fetching them)",
                 cid[:24], len(reports), trio.current_time() - began, fetching)
        return True
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def combine_ahead(content: "ContentService", terms: m.JobTerms, *, rnd: int,
                        reports: Sequence[tuple[str, str, int]], start: tuple[dict, dict, dict], work: Path,
                        coordinator: str | None, timeout: float) -> str | None:
    """Round ``rnd``'s aggregate computed from its ``reports`` as soon as they are all reported, before the
    coordinator announces it: its blocks are added to the store and its CID returned (None, logged, when it could
    not be computed). ``combine_here`` then finds the announced CID held, if it is this one, and computes nothing
    at the announcement (IPIP-0006 §2.9.1). Nothing is announced or trained from it: it is what the coordinator
    computes meanwhile, and the CID the `early` message names is still the whole of the trust."""
    began = trio.current_time()
    try:
        computed = await _combined(content, terms, rnd=rnd, reports=reports, start=start, work=work,
                                   coordinator=coordinator, timeout=timeout)
        if computed is None:
            return None
        _, cid, fetching = computed
        log.info("aggregate of round %d computed ahead from its %d reports in %.2f s (%.2f s of it fetching them): "
                 "%s…", rnd, len(reports), trio.current_time() - began, fetching, cid[:24])
        return cid
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _combined(content: "ContentService", terms: m.JobTerms, *, rnd: int, reports: Sequence[tuple[str, str, int]],
                    start: tuple[dict, dict, dict], work: Path, coordinator: str | None,
                    timeout: float) -> tuple[Path, str, float] | None:
    """(the bundle in ``work``, its CID, seconds spent fetching reports) of round ``rnd``'s aggregate computed from
    ``reports`` and ``start`` (see ``combine_here``), its blocks added to the store; None, logged, on any failure."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    began = trio.current_time()
    bound = bundle_size_bound(MAX_REPORT_BYTES, REPORT_FILES)

    async def one(index: int, report_cid: str, worker: str) -> None:
        bundle = work / f"report-{index}.tar"
        if not await content.read_local(report_cid, bundle, max_size=bound):
            providers = [worker] + ([coordinator] if coordinator and coordinator != worker else [])
            await content.fetch(report_cid, bundle, timeout=timeout, providers=providers, max_size=bound)

    try:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                for index, (report_cid, worker, _) in enumerate(reports):
                    nursery.start_soon(one, index, report_cid, worker)
        fetched = trio.current_time()
        inputs = []
        adapter, _, optimizer = start
        for index, (_, _, samples) in enumerate(reports):
            directory = await unpack_off_loop(work / f"report-{index}.tar", work / f"report-{index}",
                                              allowed=REPORT_FILES, max_bytes=MAX_REPORT_BYTES)
            await trio.to_thread.run_sync(materialize_report, directory, terms, adapter, optimizer)
            inputs.append((directory, samples))
        combined = work / "adapter"
        await trio.to_thread.run_sync(run_torch, partial(compute_aggregate, terms, inputs, combined, work / "update", rnd,
                                                         start))
        bundle = await pack_dir_off_loop(combined, work / "aggregate.tar")
        return bundle, str(await content.add_file(bundle, provide=False)), fetched - began
    except Exception as exc:  # noqa: BLE001 - any failure here costs the fetch, nothing else
        from agent.content.exchange import first_error

        error = first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        log.info("round %d's aggregate: not computed here: %s: %s", rnd, type(error).__name__, str(error)[:300])
        return None
