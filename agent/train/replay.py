"""Replay verifier: re-run one committed segment from its start checkpoint and judge it.

Rules of this file:
- The verifier trusts nothing it is handed: the chain must hash to the claimed head
  (Commitment.check), the start checkpoint must hash to the adapter and optimizer hashes the chain
  committed for the segment start, and the end checkpoint (used only to measure distances) to
  those of the segment end. A mismatch is a rejected verdict, not an exception.
- The replay uses the job's settings (TrainConfig from the spec), the seed from the commitment
  header, and the worker's recorded thread count and dtype, then runs the steps of the segment
  through the same LoraSession as training, with the worker's runtime where this machine has it
  (``replay_runtime``: unsloth work by unsloth, in the warm unsloth child), else peft. The shard must be the one the job assigned (the caller
  fetched it by CID); a different shard shows up as a batch or state mismatch.
- Judging is protocol.proof.judge_replay with protocol.proof.acceptance_tolerance: exact hash
  equality when worker and verifier environments match (CPU, float32), else per-tensor relative
  L2 ``|replay - worker| / |worker|`` over adapter and optimizer tensors within the tolerance.
- ``python -m agent.train.replay`` runs one verification in its own process and prints the
  verdict as one JSON object; the exit status is 0 when accepted, 1 when rejected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError

from agent.train.config import DTYPES, TrainConfig
from agent.train.env import environment
from agent.train.model import base_model_sha256, load_tokenizer, tensors_hash
from agent.train.recorder import checkpoint_name, read_checkpoint
from agent.train.loop import LoraSession
from agent.train.codec import FRESH
from agent.train.run import finish_round, load_shard, open_session, pad_token_id
from protocol.errors import ProofError
from protocol.proof import (
    ChainLink, Commitment, SegmentVerdict, acceptance_tolerance, batches_digest, judge_replay,
)


def relative_l2(replayed: dict[str, torch.Tensor], committed: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor ``||replayed - committed|| / ||committed||`` (absolute when ``committed`` is zero)."""
    out = {}
    for name, reference in committed.items():
        other = replayed.get(name)
        if other is None or other.shape != reference.shape:
            out[name] = float("inf")
            continue
        reference, other = reference.double(), other.double()
        norm = reference.norm().item()
        out[name] = (other - reference).norm().item() / (norm if norm > 0 else 1.0)
    out.update({name: float("inf") for name in replayed if name not in committed})
    return out


def expected_initial_adapter(config: TrainConfig, initial: Path | None = None) -> dict[str, torch.Tensor]:
    """The adapter a shard's training must start from: the LoRA seeded from the job (``config.seed``;
    A from the seed, B zero), or the adapter in directory ``initial`` (the previous round's aggregate)."""
    from safetensors.torch import load_file

    from agent.train.run import POOL, pick_device, pick_dtype, set_threads

    if initial is not None:
        return load_file(str(initial / "adapter_model.safetensors"))
    set_threads(config.threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    # the pool's model of these settings (a replay or a score takes it next) rather than a build of its own:
    # the seeded adapter is what its build left, kept beside it
    model, seeded = POOL.take(config, device, dtype, "peft")
    try:
        return {name: tensor.detach().to("cpu").clone() for name, tensor in seeded.items()}
    finally:
        POOL.give(config, device, dtype, "peft", model, seeded)


def check_initial_adapter(genesis: Path, commitment: Commitment, expected: dict[str, torch.Tensor],
                          expected_optimizer: dict[str, torch.Tensor] | None = None) -> str | None:
    """Why the proof's step-0 checkpoint is not the start it had to be, or None.

    The step-0 checkpoint must hash to the header's ``initial_adapter_hash`` (which the chain is
    bound to), and its tensors must equal ``expected``: exactly in float32, within the dtype's
    rounding otherwise (a worker training in bf16 casts the same start). Its AdamW state must be
    ``expected_optimizer`` exactly (empty: a fresh optimizer; the previous aggregate's averaged
    state when the job carries it, IPIP-0006 §2.3).
    """
    try:
        adapter, optimizer, _ = read_checkpoint(genesis)
    except (OSError, ValueError, SafetensorError) as error:
        return f"the step-0 checkpoint is unreadable: {error}"
    if tensors_hash(adapter) != commitment.header.initial_adapter_hash:
        return "the step-0 checkpoint does not hash to the proof's initial_adapter_hash"
    if set(adapter) != set(expected):
        missing = sorted(set(expected) ^ set(adapter))[:3]
        return f"the initial adapter has other tensors than the job's start (e.g. {', '.join(missing)})"
    for name in sorted(expected):
        got, want = adapter[name], expected[name]
        if got.shape != want.shape:
            return f"initial tensor {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if got.dtype == torch.float32:
            same = torch.equal(got, want.to(torch.float32))
        else:
            same = torch.allclose(got.float(), want.float(), rtol=torch.finfo(got.dtype).eps, atol=0.0)
        if not same:
            return (f"training did not start from the job's initial adapter (tensor {name} differs: "
                    "not the seeded LoRA init in round 1, or not the previous round's aggregate)")
    if tensors_hash(optimizer) != commitment.header.initial_optimizer_hash:
        return "the step-0 checkpoint's optimizer state does not hash to the proof's initial_optimizer_hash"
    if expected_optimizer is not None:
        if set(optimizer) != set(expected_optimizer) or any(
                not torch.equal(optimizer[name], expected_optimizer[name]) for name in expected_optimizer):
            return ("training did not start from the job's optimizer state (fresh in round 1 or when the job "
                    "does not carry it, else the previous aggregate's averaged AdamW state)")
    return None


def _rejected(index: int, reason: str) -> SegmentVerdict:
    return SegmentVerdict(index, False, False, float("inf"), reason)


def replay_runtime(worker_environment: dict) -> str:
    """The runtime this machine replays a proof with: the worker's own when it is unsloth and this machine
    can run unsloth (exact on the same device class: peft's kernels drift from unsloth's fused ones by
    more than bf16 noise, issue 22), else peft."""
    if worker_environment.get("backend") == "unsloth":
        from agent.train.backends import unsloth_usable

        if unsloth_usable():
            return "unsloth"
    return "peft"


def verify_segment(commitment: Commitment, index: int, *, start: Path, shard: Path, config: TrainConfig,
                   end: Path | None = None, claimed_head: bytes | None = None,
                   round_start: Path | None = None, runtime: str | None = None,
                   from_round_start: bool = False) -> SegmentVerdict | None:
    """Replay segment ``index`` of ``commitment`` from checkpoint directory ``start`` and judge it.
    ``round_start``: the round's first checkpoint (step 0), which a replay of the last segment of a
    job with a report codec needs: the last link commits the coded state (IPIP-0006 §2.8).
    ``runtime``: None picks ``replay_runtime`` of the proof's environment (unsloth runs in the warm
    unsloth child, which calls this with ``runtime="unsloth"``); "peft" or "unsloth": this process.
    ``from_round_start`` (peft, a replay expected bit for bit; IPIP-0005 §8 "What a verifier fetches"):
    ``start`` is the round's step-0 checkpoint, and the steps before the segment are replayed from it
    instead of reading the segment's start checkpoint; None (no verdict) when they do not reach the
    committed start state bit for bit: the caller then fetches that checkpoint and replays from it."""
    if from_round_start:
        runtime = "peft"
    if runtime is None:
        runtime = replay_runtime(commitment.header.environment)
        if runtime == "unsloth":
            from agent.train.backends import UnslothBackend

            return UnslothBackend().replay({
                "commitment": commitment.to_json(), "index": index, "start": str(start), "shard": str(shard),
                "config": config.to_json(), "end": str(end) if end else None,
                "claimed_head": claimed_head.hex() if claimed_head else None,
                "round_start": str(round_start) if round_start else None})
    try:
        commitment.check(claimed_head)
        start_step, adapter_hash, optimizer_hash = commitment.segment_start(index)
    except ProofError as error:
        return _rejected(index, str(error))
    header, committed = commitment.header, commitment.links[index]
    reached = (start_step, adapter_hash, optimizer_hash)  # the state the segment starts from
    if from_round_start:
        start_step, adapter_hash, optimizer_hash = commitment.segment_start(0)
    try:
        adapter, optimizer, _ = read_checkpoint(start)
    except (OSError, ValueError, SafetensorError) as error:
        return _rejected(index, f"start checkpoint {start.name} is unreadable: {error}")
    if tensors_hash(adapter) != adapter_hash or tensors_hash(optimizer) != optimizer_hash:
        return _rejected(index, f"start checkpoint {start.name} does not match the committed hashes at step {start_step}")
    named = {base_model_sha256(config.base_model), (config.base_model_sha256 or header.base_model_sha256).lower()}
    if named != {header.base_model_sha256}:
        return _rejected(index, "the proof names a different base model than the job")
    dtype = header.environment.get("dtype")
    if dtype not in DTYPES:
        return _rejected(index, f"cannot replay training in dtype {dtype!r}")
    # the worker's thread count, when this machine has that many cores (else the tolerance applies)
    threads = min(int(header.environment.get("threads", config.threads)), os.cpu_count() or 1)
    # the worker's micro-batch split (its own choice, presets.py): the same split replays the same bits
    micro = header.environment.get("micro_batch", 0)
    micro = micro if isinstance(micro, int) and 0 < micro <= config.samples_per_step else 0
    # a data-parallel proof reseeds before each micro-batch (IPIP-0005 §6.1): one process replays that rule
    parallel = header.environment.get("data_parallel", 1)
    per_micro = isinstance(parallel, int) and not isinstance(parallel, bool) and parallel > 1
    config = config.with_(seed=header.seed, threads=max(threads, 1), dtype=dtype, micro_batch_size=micro,
                          micro_batch_rng=per_micro)

    first = first_optimizer = None
    if index == len(commitment.links) - 1 and config.report_codec != "none":
        if round_start is None:
            return _rejected(index, "the last segment of a coded report needs the round's start to replay")
        try:
            first, first_optimizer, _ = read_checkpoint(round_start)
        except (OSError, ValueError, SafetensorError) as error:
            return _rejected(index, f"round start checkpoint {round_start.name} is unreadable: {error}")
        if tensors_hash(first) != commitment.header.initial_adapter_hash:
            return _rejected(index, f"round start checkpoint {round_start.name} does not match the committed start")
        if config.report_codec in FRESH and tensors_hash(first_optimizer) != commitment.header.initial_optimizer_hash:
            return _rejected(index, f"round start checkpoint {round_start.name}: its optimizer state does not match "
                                    "the committed start")
    tokenizer = load_tokenizer(config.base_model)
    examples = load_shard(config, tokenizer, shard).examples
    try:
        session = open_session(config, examples, pad_id=pad_token_id(tokenizer), initial_adapter=adapter,
                               backend=runtime)
    except (ValueError, KeyError) as error:
        return _rejected(index, f"start checkpoint {start.name} does not fit the model: {error}")
    try:
        try:
            session.load_optimizer_tensors(optimizer)
        except (ValueError, KeyError) as error:
            return _rejected(index, f"start checkpoint {start.name} does not fit the model: {error}")
        if from_round_start:
            for step in range(start_step, reached[0]):
                session.step(step)
            start_step = reached[0]
            if (tensors_hash(session.adapter_tensors()), tensors_hash(session.optimizer_tensors())) != reached[1:]:
                return None  # not bit for bit here: the segment's start checkpoint decides
        return _replay(session, commitment, index, committed, config, start_step, (first, first_optimizer), end,
                       runtime)
    finally:
        session.close()


def _replay(session: LoraSession, commitment: Commitment, index: int, committed: ChainLink, config: TrainConfig,
            start_step: int, firsts: tuple[dict | None, dict | None], end: Path | None,
            runtime: str = "peft") -> SegmentVerdict:
    """``firsts``: the round's start adapter and AdamW state, for the last segment of a coded report (else None)."""
    first, first_optimizer = firsts
    steps, losses = [], []
    for step in range(start_step, committed.step):
        result = session.step(step)
        steps.append(result.indices)
        losses.append(result.loss)
    if first is not None:
        try:
            finish_round(session, config, first, first_optimizer)
        except (ValueError, KeyError) as error:  # CodecError is a ValueError
            return _rejected(index, f"the coded end state does not replay: {error}")
    replay_adapter, replay_optimizer = session.adapter_tensors(), session.optimizer_tensors()
    replayed = ChainLink(
        step=committed.step, adapter_hash=tensors_hash(replay_adapter),
        optimizer_hash=tensors_hash(replay_optimizer), batches_digest=batches_digest(steps),
        loss=sum(losses) / len(losses),
    )
    verifier_env = environment(session.device, session.dtype, runtime, micro_batch=config.micro_batch,
                               quantization="nf4" if config.method == "qlora" else "none")
    tolerance = acceptance_tolerance(commitment.header.environment, verifier_env, config.tolerance)
    distances = None
    if end is not None and tolerance > 0 and replayed.adapter_hash != committed.adapter_hash:
        try:
            end_adapter, end_optimizer, _ = read_checkpoint(end)
        except (OSError, ValueError, SafetensorError) as error:
            return _rejected(index, f"end checkpoint {end.name} is unreadable: {error}")
        if tensors_hash(end_adapter) != committed.adapter_hash or tensors_hash(end_optimizer) != committed.optimizer_hash:
            return _rejected(index, f"end checkpoint {end.name} does not match the committed hashes")
        distances = relative_l2(replay_adapter, end_adapter)
        distances.update(relative_l2(replay_optimizer, end_optimizer))
    return judge_replay(index, committed, replayed, tolerance, distances)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.train.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--proof", type=Path, required=True, help="proof.json of the worker's run")
    parser.add_argument("--segment", type=int, required=True, help="segment index to replay")
    parser.add_argument("--checkpoints", type=Path, required=True, help="directory holding step-* checkpoints")
    parser.add_argument("--shard", type=Path, required=True, help="the shard's ChatML JSONL")
    parser.add_argument("--config", type=Path, required=True, help="train_config.json with the job's settings")
    args = parser.parse_args(argv)
    try:
        commitment = Commitment.from_json(json.loads(args.proof.read_text()))
        start_step, _, _ = commitment.segment_start(args.segment)
    except (OSError, ValueError, ProofError) as error:
        print(json.dumps({"accepted": False, "reason": f"{args.proof}: {error}"}))
        return 1
    config = TrainConfig.from_json(json.loads(args.config.read_text()))
    end = args.checkpoints / checkpoint_name(commitment.links[args.segment].step)
    started = time.time()
    verdict = verify_segment(commitment, args.segment, start=args.checkpoints / checkpoint_name(start_step),
                             end=end if end.is_dir() else None, shard=args.shard, config=config,
                             round_start=args.checkpoints / checkpoint_name(0))
    print(json.dumps({**asdict(verdict), "seconds": time.time() - started}))
    return 0 if verdict.accepted else 1


if __name__ == "__main__":
    sys.exit(main())
