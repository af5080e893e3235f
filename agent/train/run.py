"""Train one shard into a run directory: data, model, loop, proof recorder, outputs.

Rules of this file:
- ``train_shard(request, on_checkpoint)`` is the whole job of a worker's training step; it knows
  nothing of the network. The request carries the job identity only to bind it into the proof.
- Order of work: set threads, pick device and dtype, check the base model hash against the job's
  (before any training), tokenize, build the seeded LoRA, write the frozen spec, then train.
- The run directory holds:
      infernet.train.yml    the job spec as received (or the train config, if there was none)
      train_config.json     the exact TrainConfig, including the worker's own choices
      metrics.jsonl         one JSON object per logging step
      proof.json            the commitment: header, links, head (rewritten at each checkpoint)
      checkpoints/step-*/   see recorder.py
      checkpoint-final/     adapter_config.json + adapter_model.safetensors (stock peft layout)
      delta.safetensors     with a ``report_codec``: the round's end state as the report sends it
      result.json           the TrainResult
      README.md             what was trained, on what, when, how long, final loss
- ``build_lora_model`` is the only place that differs between backends: "peft" loads through
  transformers + peft; "unsloth" through unsloth's FastLanguageModel, valid only in a process that
  imported unsloth first (unsloth_runner.py). Both then get the same seeded A and the same loop.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from safetensors.torch import load_file, save_file

from agent.train.aggregate import OPTIMIZER_FILE, frozen_keys
from agent.train.codec import FRESH, PAYLOAD_FILE, encode, round_trip, save_payload
from agent.train.config import TrainConfig, TrainError
from agent.train.data import Example, PreparedShard, prepare_examples
from agent.train.env import environment, set_threads
from agent.train.loop import FUSED_LOSS, Evaluation, LoraSession, data_parallel, deterministic_cuda, refused_by_strict_mode, same_on_every_rank
from agent.train.model import (
    TOKENIZER_KEY, adapter_state, add_lora, full_model, base_model_sha256, load_adapter_state, load_base_model, load_tokenizer, pick_device,
    pick_dtype, save_adapter, seed_lora_a, tensors_hash,
)
from agent.train.recorder import OnCheckpoint, ProofRecorder, checkpoint_name, is_checkpoint, read_checkpoint
from protocol.errors import ProofError
from protocol.proof import ChainLink, Commitment, CommitmentHeader


@dataclass(frozen=True)
class TrainRequest:
    """One shard to train: the config, the files, and who/what the proof is about."""

    config: TrainConfig
    shard: Path
    run_dir: Path
    validation: Path | None = None
    initial_adapter: Path | None = None
    job_id: bytes = bytes(32)
    round: int = 1
    shard_index: int = 0
    attempt: int = 0
    worker: str = "local"
    spec_text: str | None = None

    def to_json(self) -> dict:
        return {
            "config": self.config.to_json(), "shard": str(self.shard), "run_dir": str(self.run_dir),
            "validation": str(self.validation) if self.validation else None,
            "initial_adapter": str(self.initial_adapter) if self.initial_adapter else None,
            "job_id": self.job_id.hex(), "round": self.round, "shard_index": self.shard_index,
            "attempt": self.attempt, "worker": self.worker, "spec_text": self.spec_text,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "TrainRequest":
        optional = lambda key: Path(obj[key]) if obj.get(key) else None  # noqa: E731
        return cls(
            config=TrainConfig.from_json(obj["config"]), shard=Path(obj["shard"]), run_dir=Path(obj["run_dir"]),
            validation=optional("validation"), initial_adapter=optional("initial_adapter"),
            job_id=bytes.fromhex(obj["job_id"]), round=obj["round"], shard_index=obj["shard_index"],
            attempt=obj["attempt"], worker=obj["worker"], spec_text=obj.get("spec_text"),
        )


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    head: bytes
    steps: int
    checkpoints: int
    samples: int
    tokens: int
    final_loss: float
    validation_loss: float | None
    initial_validation_loss: float | None
    train_seconds: float
    load_seconds: float
    skipped_lines: int
    dropped_examples: int
    environment: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else 0.0

    def to_json(self) -> dict:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data.update(run_dir=str(self.run_dir), adapter_dir=str(self.adapter_dir), head=self.head.hex())
        return data

    @classmethod
    def from_json(cls, obj: dict) -> "TrainResult":
        data = dict(obj)
        data.update(run_dir=Path(obj["run_dir"]), adapter_dir=Path(obj["adapter_dir"]),
                    head=bytes.fromhex(obj["head"]))
        return cls(**data)


def build_lora_model(config: TrainConfig, device: str, dtype: torch.dtype, backend: str) -> Any:
    """The base model with a seeded LoRA attached, ready for LoraSession."""
    if backend == "unsloth":
        from unsloth import FastLanguageModel  # the process imported unsloth before transformers

        model, _ = FastLanguageModel.from_pretrained(
            config.base_model, max_seq_length=config.max_seq_len, dtype=dtype,
            load_in_4bit=config.method == "qlora")
        model = FastLanguageModel.get_peft_model(
            model, r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
            target_modules=list(config.target_modules), bias="none", random_state=config.seed,
            use_gradient_checkpointing=False)
        seed_lora_a(model, config.seed)
        # unsloth's fused cross-entropy (loop.token_loss_sum); INFERNET_UNSLOTH_FUSED_LOSS=0 computes it from logits
        setattr(model, FUSED_LOSS, os.environ.get("INFERNET_UNSLOTH_FUSED_LOSS", "1") != "0")
        if config.freeze_a:
            for name, parameter in model.named_parameters():
                if ".lora_A." in name:
                    parameter.requires_grad_(False)
        return model
    model = load_base_model(config.base_model, device=device, dtype=dtype, quantize_4bit=config.method == "qlora")
    if config.method == "full":
        return full_model(model)
    if config.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return add_lora(model, rank=config.rank, alpha=config.alpha, dropout=config.dropout,
                    target_modules=config.target_modules, seed=config.seed, freeze_a=config.freeze_a)


class ModelPool:
    """Built models kept between sessions of one process, so a worker's next shard, a verifier's next
    replay and a coordinator's next score do not load the base model and build the LoRA again (on a
    GPU, seconds of reading and copying weights each time; here 0.1-0.5 s of a 1-2 s shard).

    A model is taken out while a session uses it (two sessions never share one) and given back when
    the session closes; a taken model is reset to the seeded adapter (or the session's initial one)
    and its gradients cleared, and each session builds its own AdamW, so a pooled session trains the
    same bits as a fresh one. It keeps at most ``keep`` idle models, of the most recent settings
    (key: backend, base model, method, LoRA shape and seed, device, dtype); ``INFERNET_MODEL_POOL=0``
    turns it off. Unsloth models are pooled in the warm unsloth child, the one process that builds them."""

    def __init__(self, keep: int = 1) -> None:
        import threading

        self.keep = keep
        self._idle: list[tuple[tuple, Any, dict[str, torch.Tensor]]] = []
        self._lock = threading.Lock()
        self.built = 0
        self.reused = 0

    @staticmethod
    def key(config: TrainConfig, device: str, dtype: torch.dtype, backend: str) -> tuple:
        # unsloth sizes its model for max_seq_length at load; peft's model does not depend on it
        return (backend, config.base_model, config.method, config.rank, config.alpha, config.dropout,
                tuple(config.target_modules), config.seed, config.freeze_a, device, str(dtype),
                config.max_seq_len if backend == "unsloth" else 0)

    def enabled(self) -> bool:
        import os

        return self.keep > 0 and os.environ.get("INFERNET_MODEL_POOL", "1") != "0"

    def take(self, config: TrainConfig, device: str, dtype: torch.dtype, backend: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """(model, its seeded adapter): an idle one of these settings, else a new one."""
        key = self.key(config, device, dtype, backend)
        if self.enabled():
            with self._lock:
                for index, (k, model, seeded) in enumerate(self._idle):
                    if k == key:
                        del self._idle[index]
                        self.reused += 1
                        for parameter in model.parameters():
                            parameter.grad = None
                        load_adapter_state(model, seeded)
                        return model, seeded
        model = build_lora_model(config, device, dtype, backend)
        self.built += 1
        seeded = {name: tensor.detach().clone() for name, tensor in adapter_state(model).items()}
        return model, seeded

    def warm(self, config: TrainConfig, device: str, dtype: torch.dtype, backend: str) -> bool:
        """Build the model a session of these settings will take, and keep it idle for it: True if built;
        False when one is idle already or the pool is off. Called before the work comes (``warm_model``)."""
        if not self.enabled():
            return False
        built = self.built
        model, seeded = self.take(config, device, dtype, backend)  # (an idle one of these settings, else built)
        self.give(config, device, dtype, backend, model, seeded)
        return self.built > built

    def clear(self) -> None:
        """Drop every idle model (their memory goes back once nothing else holds them)."""
        with self._lock:
            self._idle.clear()

    def give(self, config: TrainConfig, device: str, dtype: torch.dtype, backend: str, model: Any,
             seeded: dict[str, torch.Tensor]) -> None:
        if not self.enabled():
            return
        with self._lock:
            self._idle.insert(0, (self.key(config, device, dtype, backend), model, seeded))
            del self._idle[self.keep:]


POOL = ModelPool()


def open_session(config: TrainConfig, examples: list[Example], *, pad_id: int, backend: str = "peft",
                 initial_adapter: dict[str, torch.Tensor] | None = None) -> LoraSession:
    """Threads set, model built (or taken from the pool), initial adapter loaded: a session at step 0
    of its segment. ``session.close()`` gives the model back to the pool."""
    set_threads(config.threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    if device == "cuda":
        deterministic_cuda()
    try:
        model, seeded = POOL.take(config, device, dtype, backend)
    except RuntimeError as error:  # an op of the build that strict deterministic mode refuses (loop.py)
        if not refused_by_strict_mode(error, device):
            raise
        model, seeded = POOL.take(config, device, dtype, backend)
    if initial_adapter is not None:
        load_adapter_state(model, initial_adapter)
    session = LoraSession(model, examples, config, device=device, dtype=dtype, pad_id=pad_id)
    session.on_close = lambda: POOL.give(config, device, dtype, backend, model, seeded)
    return session


def warm_model(config: TrainConfig, backend: str = "peft") -> bool:
    """Before a job's first shard, replay or score: load what its first session would load then (the ML
    libraries' imports, under ``run_torch``; the base model with its LoRA, into the pool; the tokenizer), so
    the first round does not wait for it (issue 24: on this machine the imports alone took 5-7 s of round 1,
    on a GPU the model's load takes seconds to minutes). True if a model was built."""
    set_threads(config.threads)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    if device == "cuda":
        deterministic_cuda()
    load_tokenizer(config.base_model)
    return POOL.warm(config, device, dtype, backend)


MAX_VALIDATION_EXAMPLES = 256  # a coordinator scores each round on at most this many (IPIP-0006 §2.6)


def validation_scores(config: TrainConfig, path: Path, adapters: list[Path | None]) -> list[Evaluation]:
    """The score (mean loss; for DPO also reward accuracy and margin) on the first MAX_VALIDATION_EXAMPLES
    examples of ``path`` for each adapter file (None: the job's seeded initial adapter, i.e. the base
    model), one model build for all."""
    set_threads(config.threads)
    tokenizer = load_tokenizer(config.base_model)
    examples = load_shard(config, tokenizer, path).examples[:MAX_VALIDATION_EXAMPLES]
    if not examples:
        raise TrainError(f"{path}: the validation split has no example with assistant tokens")
    session = open_session(config, examples, pad_id=pad_token_id(tokenizer))
    try:
        initial = {name: tensor.clone() for name, tensor in session.adapter_tensors().items()}
        losses = []
        for adapter in adapters:
            load_adapter_state(session.model, initial if adapter is None else load_file(str(adapter)))
            losses.append(session.score(examples))
        return losses
    finally:
        session.close()


class PreparedShards:
    """Shards as ``prepare_examples`` made them, by the file's bytes and everything else they depend on (the
    tokenizer's files, ``TOKENIZER_KEY``; the config's length, packing, bad-line and objective settings). A
    worker trains the same shard round after round, and a verifier replays it: each used to read and tokenize
    it again (a chat template is rendered per record: on a real shard, seconds a round). Kept while their
    tokens total at most ``max_tokens`` (about 40 bytes each as Python tuples); the least recently used go
    first. Examples are immutable; each caller gets its own list."""

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        import threading

        self.max_tokens = max_tokens
        self._kept: dict[tuple, tuple[PreparedShard, int]] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, config: TrainConfig, tokenizer: Any, path: Path) -> PreparedShard:
        import hashlib

        settings = (config.max_seq_len, config.packing, config.skip_bad_lines, config.objective)
        tokenizer_key = getattr(tokenizer, TOKENIZER_KEY, None)
        if tokenizer_key is None:  # (a tokenizer not from load_tokenizer: nothing to key it by)
            return prepare_examples(path, tokenizer, max_seq_len=settings[0], packing=settings[1],
                                    skip_bad=settings[2], objective=settings[3])
        key = (hashlib.sha256(Path(path).read_bytes()).digest(), tokenizer_key, settings)
        with self._lock:
            kept = self._kept.pop(key, None)
            if kept is not None:
                self._kept[key] = kept  # (now the most recently used)
                self.hits += 1
                return _copied(kept[0])
        shard = prepare_examples(path, tokenizer, max_seq_len=settings[0], packing=settings[1],
                                 skip_bad=settings[2], objective=settings[3])
        tokens = sum(_tokens(example) for example in shard.examples)
        if tokens <= self.max_tokens:
            with self._lock:
                self._kept[key] = (_copied(shard), tokens)
                while sum(t for _, t in self._kept.values()) > self.max_tokens:
                    del self._kept[next(iter(self._kept))]
        return shard


def _copied(shard: PreparedShard) -> PreparedShard:
    return PreparedShard(list(shard.examples), shard.records, shard.skipped_lines, shard.dropped_examples)


def _tokens(example: Any) -> int:
    if isinstance(example, Example):
        return len(example.input_ids)
    return sum(_tokens(getattr(example, side)) for side in ("chosen", "rejected"))


SHARDS = PreparedShards()


def load_shard(config: TrainConfig, tokenizer: Any, path: Path) -> PreparedShard:
    return SHARDS.get(config, tokenizer, path)


def check_base_model(config: TrainConfig) -> str:
    """The base model's sha256; TrainError if the job names a different one."""
    actual = base_model_sha256(config.base_model)
    if config.base_model_sha256 and actual != config.base_model_sha256.lower():
        raise TrainError(
            f"base model {config.base_model}: sha256 {actual[:16]}... but the job names "
            f"{config.base_model_sha256[:16]}... (a different model)")
    return actual


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


OnStep = Callable[[int, int, float, int, float], None]
"""Called after every optimizer step with (step done, total steps, loss, tokens so far, seconds so far)."""


def _prepare(request: TrainRequest, backend: str, *, with_validation: bool = True) -> tuple:
    """(base model hash, shard, validation examples, session at step 0) for ``request``: the same on every rank."""
    config = request.config
    if config.round != request.round:
        raise TrainError(f"train config is for round {config.round}, the request for round {request.round}")
    base_hash = check_base_model(config)
    tokenizer = load_tokenizer(config.base_model)
    shard = load_shard(config, tokenizer, request.shard)
    validation = load_shard(config, tokenizer, request.validation).examples \
        if request.validation and with_validation else []
    initial = load_file(str(request.initial_adapter / "adapter_model.safetensors")) if request.initial_adapter else None
    session = open_session(config, shard.examples, pad_id=pad_token_id(tokenizer), backend=backend,
                           initial_adapter=initial)
    if config.carry_optimizer and request.initial_adapter is not None:  # IPIP-0006 §2.3
        state_file = request.initial_adapter / OPTIMIZER_FILE
        if not state_file.exists():
            raise TrainError(f"{request.initial_adapter}: the job carries the optimizer state across rounds, "
                             f"but the initial adapter has no {OPTIMIZER_FILE}")
        try:
            session.load_optimizer_tensors(load_file(str(state_file)))
        except (ValueError, KeyError) as error:
            raise TrainError(f"{state_file}: does not fit the model's trainable tensors: {error}") from None
    return base_hash, shard, validation, session


def finish_round(session: LoraSession, config: TrainConfig, start: dict[str, torch.Tensor],
                 start_optimizer: dict[str, torch.Tensor] | None = None) -> dict | None:
    """After a round's last step, with a ``report_codec``: the state becomes what the report's
    payload decodes to (IPIP-0006 §2.8), and the payload is returned; the last link commits that
    state. Training, replicas and a replay of the last segment all call this. None: no codec.
    ``start_optimizer``: the AdamW state the round started from (``int4-fresh`` codes what it added)."""
    if config.report_codec == "none":
        return None
    optimizer = session.optimizer_tensors() if config.carry_optimizer else {}
    payload, adapter, state = round_trip(start, session.adapter_tensors(), optimizer,
                                         frozen_keys(start, config.freeze_a), config.report_codec,
                                         start_optimizer if config.carry_optimizer else None)
    load_adapter_state(session.model, adapter)
    if config.carry_optimizer:
        session.load_optimizer_tensors(state)
    return payload


def _starts(session: LoraSession, config: TrainConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Copies of what the session starts from, for finish_round: the adapter (the round's start), and the
    carried AdamW state only where the report codec reads it (``int4-fresh``; else None: a copy of the
    whole state would cost every shard's start for nothing)."""
    def copied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}

    reads_state = config.report_codec in FRESH and config.carry_optimizer
    return copied(session.adapter_tensors()), copied(session.optimizer_tensors()) if reads_state else None


def _check_replicas(session: LoraSession, link: ChainLink) -> None:
    """Data parallel: the state a link commits to must be every rank's (they all took the same steps)."""
    if not same_on_every_rank(link.adapter_hash + link.optimizer_hash, session.device):
        raise TrainError(f"data-parallel ranks disagree on the adapter after step {link.step}")


def train_replica(request: TrainRequest, backend: str = "peft") -> None:
    """A data-parallel rank other than 0 (loop.py): the same session and steps as rank 0, which alone
    records the proof and writes the run; this rank writes nothing and checks its state at every link."""
    _, shard, _, session = _prepare(request, backend, with_validation=False)
    config = request.config
    start, start_optimizer = _starts(session, config)
    total_steps = config.total_steps(len(shard.examples))
    try:
        for step in range(total_steps):
            result = session.step(step)
            if result.step == total_steps:
                finish_round(session, config, start, start_optimizer)
            if is_checkpoint(result.step, config.checkpoint_every, total_steps):
                digest = tensors_hash(session.adapter_tensors()) + tensors_hash(session.optimizer_tensors())
                if not same_on_every_rank(digest, session.device):
                    raise TrainError(f"data-parallel ranks disagree on the adapter after step {result.step}")
    finally:
        session.close()


def train_shard(request: TrainRequest, on_checkpoint: OnCheckpoint | None = None,
                backend: str = "peft", *, resume: bool = False, on_step: OnStep | None = None) -> TrainResult:
    """Train ``request.shard`` into ``request.run_dir``; see the module docstring. In a data-parallel
    group (agent/train/parallel.py) this is rank 0's part; the others run ``train_replica``. With
    ``resume``, the run directory's last intact checkpoint is loaded and training goes on from it
    (``resume_point``; one process only)."""
    started = time.time()
    prepared = _prepare(request, backend)
    try:
        return _train(request, prepared, started, on_checkpoint, backend, resume=resume, on_step=on_step)
    finally:
        prepared[3].close()


def _train(request: TrainRequest, prepared: tuple, started: float, on_checkpoint: OnCheckpoint | None,
           backend: str, *, resume: bool, on_step: OnStep | None) -> TrainResult:
    config = request.config
    base_hash, shard, validation, session = prepared
    start, start_optimizer = _starts(session, config)
    world, _ = data_parallel()
    if resume and world > 1:
        raise TrainError("resuming a run is done in one process, not data-parallel")
    run_dir = request.run_dir
    if resume and (run_dir / "result.json").exists():
        raise TrainError(f"{run_dir}: this run already finished (result.json); nothing to resume")
    if resume and not (run_dir / "proof.json").exists():
        raise TrainError(f"{run_dir}: no proof.json, so no checkpoint to resume from")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "infernet.train.yml").write_text(
        request.spec_text if request.spec_text is not None
        else "# no job spec was given; the train config this run used:\n"
        + yaml.safe_dump(config.to_json(), sort_keys=True))
    (run_dir / "train_config.json").write_text(json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n")

    header = CommitmentHeader(
        job_id=request.job_id, round=request.round, shard=request.shard_index, attempt=request.attempt,
        worker=request.worker, base_model_sha256=base_hash, seed=config.seed,
        checkpoint_every=config.checkpoint_every, initial_adapter_hash=tensors_hash(session.adapter_tensors()),
        initial_optimizer_hash=tensors_hash(session.optimizer_tensors()),
        environment=environment(session.device, session.dtype, backend, micro_batch=config.micro_batch,
                                quantization="nf4" if config.method == "qlora" else "none", processes=world),
    )
    total_steps = config.total_steps(len(shard.examples))
    recorder = ProofRecorder(header, run_dir, total_steps, on_checkpoint,
                             before_commit=partial(_check_replicas, session) if world > 1 else None)
    try:
        return _run_steps(request, session, recorder, shard, validation, (start, start_optimizer), base_hash, started,
                          resume, on_step)
    finally:
        recorder.close()


def writes_in_background(session: LoraSession) -> bool:
    """Whether checkpoints are hashed and written in the recorder's writer thread: on a GPU, which trains on
    meanwhile; on the CPU the thread would take the training's own cores."""
    return session.device != "cpu"


def _run_steps(request: TrainRequest, session: LoraSession, recorder: ProofRecorder, shard: PreparedShard,
               validation: list[Example], starts: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
               base_hash: str, started: float, resume: bool, on_step: OnStep | None) -> TrainResult:
    """``starts``: the round's start adapter and AdamW state (for the report codec)."""
    config, run_dir, total_steps = request.config, request.run_dir, recorder.total_steps
    start, start_optimizer = starts
    started_at = datetime.fromtimestamp(started, timezone.utc)
    if resume:
        initial_validation = session.evaluate(validation) if validation else None  # before the checkpoint loads
        first_step, tokens = resume_point(session, recorder)
    else:
        recorder.start(session)
        initial_validation = session.evaluate(validation) if validation else None
        first_step, tokens = 0, 0
    load_seconds = time.time() - started
    if writes_in_background(session):
        recorder.background()

    train_started = time.time()
    resumed_tokens = tokens  # counted before a resume: not this session's throughput
    window_losses: list[float] = []
    last_loss = float("nan")
    validation_loss = initial_validation
    payload = None
    with open(run_dir / "metrics.jsonl", "a" if resume else "w", encoding="utf-8") as metrics:
        for step in range(first_step, total_steps):
            result = session.step(step)
            if result.step == total_steps:
                payload = finish_round(session, config, start, start_optimizer)
            recorder.after_step(session, result.step, result.indices, result.loss)
            tokens += result.tokens
            window_losses.append(result.loss)
            last_loss = result.loss
            if on_step is not None:
                on_step(result.step, total_steps, result.loss, tokens, time.time() - train_started)
            if result.step % config.log_every and result.step != total_steps:
                continue
            elapsed = time.time() - train_started
            line = {"step": result.step, "round": config.round, "loss": sum(window_losses) / len(window_losses),
                    "learning_rate": session.optimizer.param_groups[0]["lr"], "tokens": tokens,
                    "tokens_per_s": (tokens - resumed_tokens) / elapsed if elapsed else 0.0, "elapsed_s": elapsed}
            if validation:
                validation_loss = session.evaluate(validation)
                line["validation_loss"] = validation_loss
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
            window_losses = []
    recorder.finish()
    train_seconds = time.time() - train_started

    adapter_dir = run_dir / "checkpoint-final"
    save_adapter(adapter_dir, session.model, session.adapter_tensors())
    if config.carry_optimizer:  # the coordinator averages it into the next round's start
        save_file(session.optimizer_tensors(), str(adapter_dir / OPTIMIZER_FILE), metadata={"format": "pt"})
    if payload is None and config.report_codec != "none":  # resumed after the last link: the state is coded
        payload = encode(start, session.adapter_tensors(),
                         session.optimizer_tensors() if config.carry_optimizer else {}, frozen_keys(start, config.freeze_a),
                         config.report_codec, start_optimizer if config.carry_optimizer else None)
    if payload is not None:
        save_payload(run_dir / PAYLOAD_FILE, payload, config.report_codec)
    outcome = TrainResult(
        run_dir=run_dir, adapter_dir=adapter_dir, head=recorder.head, steps=total_steps,
        checkpoints=len(recorder.links), samples=total_steps * config.samples_per_step, tokens=tokens,
        final_loss=last_loss, validation_loss=validation_loss, initial_validation_loss=initial_validation,
        train_seconds=train_seconds, load_seconds=load_seconds, skipped_lines=shard.skipped_lines,
        dropped_examples=shard.dropped_examples, environment=dict(recorder.header.environment),
    )
    (run_dir / "result.json").write_text(json.dumps(outcome.to_json(), indent=2, sort_keys=True) + "\n")
    (run_dir / "README.md").write_text(_readme(request, outcome, shard, base_hash, started_at))
    return outcome


def resume_point(session: LoraSession, recorder: ProofRecorder) -> tuple[int, int]:
    """Load the run's last intact checkpoint into ``session`` and its chain into ``recorder``.

    The proof header written before must be the one this session would write (same job, base
    model, seed, environment), else TrainError. A checkpoint counts only if its adapter and
    optimizer tensors hash to what its chain link committed to; later links and checkpoints (cut
    off by the interruption) are dropped, and metrics.jsonl is cut back to that step. Returns
    (the step to go on from, tokens counted up to it from metrics.jsonl)."""
    run_dir = recorder.run_dir
    try:
        saved = Commitment.from_json(json.loads((run_dir / "proof.json").read_text()))
    except (ValueError, ProofError) as error:
        raise TrainError(f"{run_dir / 'proof.json'}: cannot resume from it: {error}") from None
    mine, theirs = recorder.header.to_json(), saved.header.to_json()
    if mine != theirs:
        field_name = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
        raise TrainError(f"{run_dir}: cannot resume here: the run's proof header differs in {field_name} "
                         f"({theirs.get(field_name)!r} there, {mine.get(field_name)!r} here)")
    links = list(saved.links)
    keep = 0
    for count in range(len(links), 0, -1):
        link, directory = links[count - 1], recorder.checkpoint_dir(links[count - 1].step)
        if not (directory / "state.json").is_file():
            continue
        adapter, optimizer, _ = read_checkpoint(directory)
        if tensors_hash(adapter) == link.adapter_hash and tensors_hash(optimizer) == link.optimizer_hash:
            load_adapter_state(session.model, adapter)
            session.load_optimizer_tensors(optimizer)
            keep = count
            break
    if keep == 0:  # not one checkpoint after step 0: start over, as if fresh
        recorder.start(session)
    recorder.links = links[:keep]
    recorder.head = Commitment(recorder.header, tuple(recorder.links)).head
    recorder._write_proof()
    step = links[keep - 1].step if keep else 0
    for stale in (run_dir / "checkpoints").glob("step-*"):
        if stale.name > checkpoint_name(step):
            import shutil

            shutil.rmtree(stale, ignore_errors=True)
    tokens = 0
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        metrics.write_text("".join(line + "\n" for line in kept))
        tokens = json.loads(kept[-1])["tokens"] if kept else 0
    return step, tokens


def _readme(request: TrainRequest, result: TrainResult, shard: PreparedShard, base_hash: str,
            started_at: datetime) -> str:
    config = request.config
    dpo = config.objective == "dpo"
    finished_at = datetime.now(timezone.utc)
    validation = (f"{result.initial_validation_loss:.4f} -> {result.validation_loss:.4f}"
                  if result.validation_loss is not None else "no validation split")
    full = config.method == "full"
    method = ("full fine-tuning (every weight trained) via torch" if full else
              f"{config.method} via {result.environment.get('backend')}, rank {config.rank}, alpha {config.alpha}, "
              f"dropout {config.dropout}, targets {', '.join(config.target_modules)}, "
              f"A {'frozen (FFA-LoRA)' if config.freeze_a else 'trained'}")
    load = ("The fine-tuned weights are in `checkpoint-final/adapter_model.safetensors`, under the base model's "
            "state-dict names (`model.load_state_dict(safetensors.torch.load_file(...))` on the base model, or "
            "`infernet infer`/`publish` on this run)" if full else
            'The adapter is in `checkpoint-final/` (load with `peft.PeftModel.from_pretrained(base, "checkpoint-final")`)')
    return f"""# {"Full fine-tuning" if full else "LoRA training"} run

- **Base model**: `{config.base_model}` (sha256 `{base_hash}`)
- **Method**: {f"DPO (beta {config.dpo_beta}, reference: the base model), " if dpo else ""}{method}
- **Data**: `{request.shard}`: {shard.records} records, {len(shard.examples)} {"preference pairs" if dpo else "examples"} \
({shard.skipped_lines} bad lines skipped, {shard.dropped_examples} dropped with no {"completion" if dpo else "assistant"} tokens)
- **Job**: `{request.job_id.hex()}` round {request.round}, shard {request.shard_index}, attempt {request.attempt}, worker `{request.worker}`
- **When**: {started_at.isoformat(timespec="seconds")} to {finished_at.isoformat(timespec="seconds")} \
({(finished_at - started_at).total_seconds():.1f} s; training {result.train_seconds:.1f} s, \
{result.tokens_per_second:.0f} tokens/s)
- **Steps**: {result.steps} x {config.batch_size} x {config.gradient_accumulation_steps} examples, \
learning rate {config.learning_rate}, seed {config.seed}
- **Final training loss**: {result.final_loss:.4f}; validation loss {validation}
- **Proof**: {result.checkpoints} checkpoints every {config.checkpoint_every} steps, chain head `{result.head.hex()}`
- **Environment**: {", ".join(f"{k}={v}" for k, v in sorted(result.environment.items()))}

{load};
`metrics.jsonl` has one line per logging step, `proof.json` the checkpoint hash chain.
"""
