"""TrainConfig: every setting one shard's training reads, in one frozen dataclass.

Rules of this file:
- Field names are the job spec's (protocol/jobspec.py); ``from_terms`` is the one mapping from a job's terms
  (``from_spec`` goes through the terms too: protocol/jobspec.to_terms); the spec
  decides what a job trains, these fields only carry it into agent/train.
- Settings that are the worker's own choice (threads, device, dtype, micro-batch, logging) live here
  too, with defaults; they never change which samples a step sees, only how fast and on what.
  ``packing`` does change them, so it comes from the job (``training.packing``).
  ``threads`` is always explicit: it is passed to ``torch.set_num_threads`` and recorded in the
  proof header, because it changes float results.
- ``max_steps = 0`` means "as many steps as ``epochs`` passes over the shard take".
- ``round`` is the job round the training belongs to: the shard's sample stream continues across
  rounds (round r's step s draws the samples of stream position (r-1)·steps + s, or after the steps of
  the job's ``first_round_steps`` rounds: protocol/schedule.stream_offset), so a job's rounds
  walk on through the shard's epochs instead of repeating round 1's batches. ``learning_rate`` is
  already the round's (protocol/schedule.py).
This module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from protocol.proof import shard_steps  # one rule: the mirrors' checkpoint cap is read from it
from protocol.messages import OBJECTIVES, REPORT_CODECS
from protocol.schedule import INNER_SCHEDULES, round_steps, stream_offset

METHODS = ("lora", "qlora", "full")
RUNTIMES = ("peft", "unsloth")
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


class TrainError(Exception):
    """Training cannot run as asked; ``str()`` is the one line to show the operator."""


def _default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    base_model: str = ""
    base_model_sha256: str | None = None
    method: str = "lora"
    runtime: str = "peft"
    seed: int = 0
    # input
    validation_split: float = 0.0
    # training
    epochs: int = 1
    learning_rate: float = 2e-4
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_seq_len: int = 512
    max_steps: int = 0
    first_round_steps: tuple[int, ...] = ()  # the job's first rounds' steps, before max_steps a round
    round: int = 1
    carry_optimizer: bool = False  # start from the initial adapter's averaged AdamW state (IPIP-0006 §2.3)
    inner_schedule: str = "constant"  # the rate within a round (protocol/schedule.inner_rate_factor)
    report_codec: str = "none"  # none | int8 | int4 | int4-log | int4-fresh: the end state goes through agent/train/codec.py (IPIP-0006 §2.8)
    objective: str = "sft"  # sft | dpo: what a step's loss is (loop.Objective; IPIP-0005 §6.2)
    dpo_beta: float = 0.1  # DPO's beta: how far the policy may move from the reference
    # lora
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    freeze_a: bool = True
    # proof
    checkpoint_every: int = 20
    verify_segments: int = 2
    tolerance: float | None = None
    # the worker's own choices
    threads: int = field(default_factory=_default_threads)
    device: str = "auto"
    dtype: str = "auto"
    packing: bool = False
    micro_batch_size: int = 0  # samples per forward pass; 0: the job's batch_size (agent/train/presets.py)
    micro_batch_rng: bool = False  # reseed before each micro-batch: a data-parallel proof's rule (loop.py)
    log_every: int = 10
    skip_bad_lines: bool = False
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"method must be one of {METHODS}"),
            (self.runtime in RUNTIMES, f"runtime must be one of {RUNTIMES}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (self.device in DEVICES, f"device must be one of {DEVICES}"),
            (self.batch_size >= 1 and self.gradient_accumulation_steps >= 1, "batch sizes must be >= 1"),
            (self.micro_batch_size >= 0, "micro_batch_size must be >= 0 (0: the job's batch_size)"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (self.threads >= 1, "threads must be >= 1"),
            (self.max_seq_len >= 8, "max_seq_len must be >= 8"),
            (self.epochs >= 1 and self.max_steps >= 0, "epochs must be >= 1 and max_steps >= 0"),
            (self.round >= 1, "round must be >= 1"),
            (self.report_codec in REPORT_CODECS, f"report_codec must be one of {REPORT_CODECS}"),
            (self.inner_schedule in INNER_SCHEDULES, f"inner_schedule must be one of {INNER_SCHEDULES}"),
            (self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}"),
            (self.dpo_beta > 0, "dpo_beta must be > 0"),
            (not (self.packing and self.objective == "dpo"), "packing is for sft jobs, not dpo"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainError(f"train config: {message}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "first_round_steps", tuple(self.first_round_steps))

    @property
    def micro_batch(self) -> int:
        """Samples per forward pass: the worker's choice, else the job's batch_size."""
        return self.micro_batch_size or self.batch_size

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps

    def total_steps(self, n_examples: int) -> int:
        """Optimizer steps for one shard in this round: ``max_steps`` if set (``first_round_steps[round - 1]`` in
        the job's first rounds: protocol/schedule.round_steps), else ``epochs`` passes (rounded up)."""
        return shard_steps(round_steps(self.max_steps, self.first_round_steps, self.round), self.epochs, n_examples,
                           self.samples_per_step)

    def stream_offset(self, n_examples: int) -> int:
        """Where this round's step 0 is in the shard's sample stream: the steps of the rounds before it."""
        return stream_offset(shard_steps(self.max_steps, self.epochs, n_examples, self.samples_per_step),
                             self.first_round_steps, self.round)

    @classmethod
    def from_terms(cls, terms: Any, base_model_path: str, *, round: int = 1, **local: Any) -> "TrainConfig":
        """What agent/train needs from a job's terms (protocol/messages.JobTerms) to train (or replay)
        round ``round``; ``base_model_path`` is this peer's local copy; ``local`` sets worker choices.
        The round's learning rate follows the job's schedule (protocol/schedule.py). The one mapping
        terms -> config (issue 23): workers, verifiers, local runs and estimates all use it."""
        from protocol.schedule import round_learning_rate

        t, lora, proof = terms.training, terms.lora, terms.proof
        learning_rate = round_learning_rate(t.learning_rate, round, terms.rounds, schedule=t.schedule,
                                            warmup_rounds=t.warmup_rounds)
        return cls(
            base_model=base_model_path, base_model_sha256=terms.base_model_sha256.hex(), method=terms.method,
            runtime=terms.runtime, seed=terms.seed, epochs=t.epochs, learning_rate=learning_rate, round=round,
            carry_optimizer=t.optimizer_state == "carried", report_codec=t.report_codec,
            inner_schedule=t.inner_schedule, packing=t.packing, objective=t.objective, dpo_beta=t.dpo_beta,
            batch_size=t.batch_size, gradient_accumulation_steps=t.gradient_accumulation_steps,
            max_seq_len=t.max_seq_len, max_steps=t.max_steps, first_round_steps=t.first_round_steps,
            rank=lora.rank, alpha=lora.alpha,
            dropout=lora.dropout, target_modules=tuple(lora.target_modules), freeze_a=lora.freeze_a,
            checkpoint_every=proof.checkpoint_every, verify_segments=proof.verify_segments,
            tolerance=proof.tolerance, **local,
        )

    @classmethod
    def from_spec(cls, spec: Any, **local: Any) -> "TrainConfig":
        """The training settings of a JobSpec for a run on this machine (``train run --local``, estimates):
        the spec as terms (protocol/jobspec.to_terms), then ``from_terms``, with what only the spec has:
        its base model as written, its sha256 if given, its validation split and its learning rate as
        written (a local run is one run, not a job's round: it trains max_steps, not the first rounds' steps)."""
        from protocol.jobspec import to_terms

        sha256 = spec.base_model_sha256
        terms = to_terms(spec, submitter="", base_model_sha256=bytes.fromhex(sha256) if sha256 else bytes(32))
        return cls.from_terms(terms, spec.base_model, **local).with_(
            base_model_sha256=sha256, validation_split=spec.input.validation_split,
            learning_rate=spec.training.learning_rate, first_round_steps=())  # one run: max_steps

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        data["first_round_steps"] = list(self.first_round_steps)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_(self, **changes: Any) -> "TrainConfig":
        return replace(self, **changes)
