"""Settings chosen from the machine: the micro-batch that fits in free VRAM, and named presets.

Rules of this file:
- The job fixes the *effective* batch (``batch_size * gradient_accumulation_steps`` samples per
  optimizer step): which samples a step sees, the proof's batch digests and the token-weighted mean
  loss (loop.py) depend only on it. The worker may choose how many samples go through the model at
  once (``micro_batch_size``): the largest divisor of the effective batch whose estimated memory fits
  in the free VRAM of its device. Accumulation is then ``effective / micro``. The choice is recorded
  in the proof header (``environment.micro_batch``) and a verifier replays with the same split.
- The memory estimate is deliberately rough and conservative (no gradient checkpointing):
  weights (4-bit for qlora: 0.55 byte per parameter of the linear layers, embeddings in the compute
  dtype) + LoRA state + per-sample activations ``layers * seq * (18 * hidden + 4 * intermediate) *
  dtype bytes`` + logits ``seq * vocab * 12`` bytes (fp32 logits, their softmax and gradient), plus
  a fixed CUDA context reserve. ``plan_batches`` takes declared sizes, so it is tested without a GPU.
- On a CPU (``free_vram_gb is None``) the job's own split is kept: CPU runs must replay bit for bit.
- Presets: ``quick-test`` (a smoke run: at most 20 steps, a checkpoint every 10, sequences <= 256
  tokens) and ``auto`` (device, dtype and micro-batch from what this machine measures).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS = ("quick-test", "auto")
CUDA_RESERVE_GB = 1.0
"""CUDA context, allocator slack and kernels' workspaces, kept free whatever the model."""
FILL = 0.85
"""Share of the free VRAM the plan may use."""
GB = float(1 << 30)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        hidden = int(config["hidden_size"])
        return cls(hidden, int(config.get("intermediate_size", 4 * hidden)), int(config["num_hidden_layers"]),
                   int(config["vocab_size"]), bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelShape":
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder's linear layers (attention as 4 h x h, MLP as 3 h x i)."""
        return self.layers * (4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    accumulation: int
    fits: bool  # False: even one sample at a time is estimated not to fit
    estimate_gb: float  # estimated peak with this micro-batch


def weights_gb(shape: ModelShape, *, method: str, dtype_bytes: int) -> float:
    linear = shape.linear_params * (0.55 if method == "qlora" else dtype_bytes)
    return (linear + shape.embedding_params * dtype_bytes) / GB


def sample_gb(shape: ModelShape, seq_len: int, dtype_bytes: int) -> float:
    """Estimated activation memory of one sample of ``seq_len`` tokens in training."""
    activations = shape.layers * seq_len * (18 * shape.hidden + 4 * shape.intermediate) * dtype_bytes
    logits = seq_len * shape.vocab * 12
    return (activations + logits) / GB


def plan_batches(effective_batch: int, free_vram_gb: float, shape: ModelShape, *, seq_len: int,
                 method: str = "lora", dtype_bytes: int = 2) -> BatchPlan:
    """The largest micro-batch dividing ``effective_batch`` whose estimated memory fits in free VRAM."""
    if effective_batch < 1:
        raise ValueError("effective batch must be >= 1")
    fixed = weights_gb(shape, method=method, dtype_bytes=dtype_bytes) + CUDA_RESERVE_GB
    per_sample = sample_gb(shape, seq_len, dtype_bytes)
    budget = free_vram_gb * FILL - fixed
    divisors = [d for d in range(effective_batch, 0, -1) if effective_batch % d == 0]
    for micro in divisors:
        if micro * per_sample <= budget:
            return BatchPlan(micro, effective_batch // micro, True, fixed + micro * per_sample)
    return BatchPlan(1, effective_batch, False, fixed + per_sample)


def auto_micro_batch(config: Any, free_vram_gb: float | None, model_dir: str | Path) -> BatchPlan:
    """The plan for a TrainConfig on this machine; on a CPU (None) the job's own split."""
    effective = config.samples_per_step
    if free_vram_gb is None:
        return BatchPlan(config.batch_size, config.gradient_accumulation_steps, True, 0.0)
    dtype_bytes = 4 if config.dtype == "float32" else 2
    return plan_batches(effective, free_vram_gb, ModelShape.from_dir(model_dir), seq_len=config.max_seq_len,
                        method=config.method, dtype_bytes=dtype_bytes)


def apply_preset(config: Any, preset: str, *, free_vram_gb: float | None, model_dir: str | Path) -> Any:
    """``config`` with a preset's changes (see the module docstring); ValueError for an unknown name."""
    if preset == "quick-test":
        return config.with_(max_steps=min(config.max_steps or 20, 20), checkpoint_every=min(config.checkpoint_every, 10),
                            max_seq_len=min(config.max_seq_len, 256))
    if preset == "auto":
        plan = auto_micro_batch(config, free_vram_gb, model_dir)
        return config.with_(device="auto", dtype="auto", micro_batch_size=plan.micro_batch)
    raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")


# -- presets for `infernet train init --preset`: a whole spec, tuned for a purpose ---------------------

SPEC_PRESETS: dict[str, tuple[str, dict[tuple[str, str], str]]] = {
    # name -> (what it is for, {(section, key): value}); "" is the top level
    "quick-test": ("a smoke run: checks data, model and machine in a minute or two; not a useful adapter", {
        ("input", "validation_split"): "0.1", ("training", "max_steps"): "20", ("training", "max_seq_len"): "256",
        ("training", "batch_size"): "4", ("lora", "rank"): "8", ("lora", "alpha"): "16",
        ("proof", "checkpoint_every"): "10"}),
    "balanced": ("a useful adapter at moderate cost: all attention projections, rank 16, two epochs, "
                 "examples packed into 1024-token sequences", {
        ("input", "validation_split"): "0.05", ("training", "epochs"): "2", ("training", "learning_rate"): "0.0002",
        ("training", "batch_size"): "4", ("training", "gradient_accumulation_steps"): "4",
        ("training", "max_seq_len"): "1024", ("training", "packing"): "true", ("lora", "rank"): "16",
        ("lora", "alpha"): "32",
        ("lora", "target_modules"): "[q_proj, k_proj, v_proj, o_proj]", ("proof", "checkpoint_every"): "50"}),
    "quality": ("the best adapter for the data: every projection, rank 32, three epochs, examples packed into "
                "2048-token sequences", {
        ("input", "validation_split"): "0.1", ("training", "epochs"): "3", ("training", "learning_rate"): "0.0001",
        ("training", "batch_size"): "4", ("training", "gradient_accumulation_steps"): "8",
        ("training", "max_seq_len"): "2048", ("training", "packing"): "true", ("lora", "rank"): "32",
        ("lora", "alpha"): "64",
        ("lora", "target_modules"): "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
        ("proof", "checkpoint_every"): "100"}),
}


def preset_spec(template: str, preset: str) -> str:
    """The commented spec ``template`` with a preset's values set in place (comments kept)."""
    if preset not in SPEC_PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(SPEC_PRESETS)})")
    purpose, values = SPEC_PRESETS[preset]
    return spec_with_values(template, values, f"# preset {preset}: {purpose}.\n")


def spec_with_values(template: str, values: dict[tuple[str, str], str], intro: str = "") -> str:
    """The commented spec ``template`` with ``values`` ({(section, key): YAML value text}, "" the top level)
    set in place, comments kept; a key the template shows commented out (``# hf: ...``) is set by uncommenting
    it, and a value None comments a key out. ValueError for a key the template does not show."""
    import re

    lines = template.splitlines()
    section = ""
    done: set[tuple[str, str]] = set()
    for i, line in enumerate(lines):
        header = re.match(r"^([a-z_]+):\s*(#.*)?$", line)
        if header:
            section = header.group(1)
            continue
        if line and not line[0].isspace():
            section = ""
        match = re.match(r"^(\s*)(# )?([a-z_]+):( +)(\[[^\]]*\]|\"[^\"]*\"|\S+)( *)(#.*)?$", line)
        if not match or (section, match.group(3)) not in values:
            continue
        key = (section, match.group(3))
        value = values[key]
        if value is None and match.group(2):
            continue  # already commented out
        if value is None:  # commented out, as the template shows the keys it leaves unset
            lines[i] = f"{match.group(1)}# {match.group(3)}:{match.group(4)}{match.group(5)}{match.group(6)}" + \
                (match.group(7) or "")
            done.add(key)
            continue
        head = f"{match.group(1)}{match.group(3)}:{match.group(4)}{value}"
        comment = match.group(7)
        column = match.start(7) if comment else 0  # keep the comment where it was, when the value fits
        lines[i] = (head.ljust(column - 1) + " " + comment) if comment else head
        done.add(key)
    missing = set(values) - done
    if missing:
        raise ValueError(f"the template has no key {'.'.join(filter(None, sorted(missing)[0]))}")
    return intro + "\n".join(lines) + "\n"
