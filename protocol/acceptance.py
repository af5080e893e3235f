"""When a shard report is accepted: the checks a verifier makes before it replays anything, as pure
functions of what it fetched (IPIP-0005 §8, checks R1–R6; the replay itself is §8's 1–4).

Rules of this file:
- Pure: facts in (the proof's header fields, the report's and the chain's counts, the adapter's
  config and per-tensor facts measured by the caller: name, shape, all finite, largest magnitude),
  the first refusal out as one line, or None. No torch, no I/O: the agent measures, the rule decides,
  so every verifier (and a successor coordinator) refuses the same report for the same reason.
- The order is the order of IPIP-0005 §8 "Report checks": the first that fails is the verdict's
  reason. Before this file the checks and one bound no document stated (|x| > 1e4 rejects) lived in
  the coordinator (issue 23).
- ``MAX_ABS_VALUE``: no adapter or optimizer tensor element may exceed it in magnitude. LoRA factors
  of a trained adapter stay within a few units (the tiny model's: |x| < 2; a rank-16 adapter of a 7B
  model: well under 10); 1e4 leaves room for any honest run and refuses overflow-scale garbage
  that would poison the aggregate before any replay runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_ABS_VALUE = 1e4
# what a full fine-tuning's adapter_config.json says (IPIP-0005 §6.3): its adapter_model.safetensors holds weights
FULL_CONFIG = {"infernet_method": "full"}

HEADER_FIELDS = ("job_id", "round", "shard", "attempt", "worker", "seed", "checkpoint_every", "base_model_sha256")
"""The proof header's fields that must equal the report's and the job's (R2), in the order checked."""


@dataclass(frozen=True)
class TensorFacts:
    """What the verifier measured of one tensor of the reported adapter."""

    name: str
    shape: tuple[int, ...]
    finite: bool
    max_abs: float


def header_refusal(header: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """R2: every field of ``HEADER_FIELDS`` in the proof's header equals what the report and the job say."""
    for name in HEADER_FIELDS:
        if header.get(name) != expected.get(name):
            return (f"proof header {name} is {str(header.get(name))[:70]!r}, "
                    f"expected {str(expected.get(name))[:70]!r}")
    return None


def chain_refusal(reported_checkpoints: int, links: int, heads: Sequence[bytes],
                  gossiped: Iterable[tuple[int, bytes]]) -> str | None:
    """R3: the proof has the report's number of checkpoints (at least one), and its chain passes through
    every head the worker gossiped (``gossiped``: (checkpoint index, chain head))."""
    if links != reported_checkpoints or not links:
        return f"report says {reported_checkpoints} checkpoints, the proof has {links}"
    for index, head in gossiped:
        if index >= len(heads) or heads[index] != head:
            return f"chain does not pass through the head gossiped at checkpoint {index}"
    return None


def adapter_refusal(config: Mapping[str, Any], tensors: Sequence[TensorFacts], rank: int,
                    target_modules: Sequence[str], method: str = "lora") -> str | None:
    """R4: the adapter is the job's: its config names the job's rank and target modules, it has tensors,
    each LoRA factor has the rank, and every value is finite and at most ``MAX_ABS_VALUE`` in magnitude.
    A full fine-tuning job's (``method`` "full"): its config says ``"infernet_method": "full"`` and no LoRA
    factor is among its tensors; which weights, and their shapes, the replay of its start holds to the job
    (IPIP-0005 §8 rule 5)."""
    if method == "full":
        if any(config.get(key) != value for key, value in FULL_CONFIG.items()):
            return "the job fine-tunes every weight, but the report's adapter_config.json does not say full"
        if any("lora_" in t.name for t in tensors):
            return next(f"{t.name}: a LoRA factor in a full fine-tuning's weights" for t in tensors if "lora_" in t.name)
        return _values_refusal(tensors)
    if config.get("r") != rank:
        return f"adapter rank {config.get('r')!r}, the job trains rank {rank}"
    if sorted(config.get("target_modules") or []) != sorted(target_modules):
        return f"adapter targets {config.get('target_modules')!r}, the job {list(target_modules)}"
    if not tensors:
        return "adapter has no tensors"
    for t in tensors:
        if ("lora_A" in t.name and (not t.shape or t.shape[0] != rank)) or \
                ("lora_B" in t.name and (not t.shape or t.shape[-1] != rank)):
            return f"{t.name}: shape {tuple(t.shape)} does not have rank {rank}"
    return _values_refusal(tensors)


def _values_refusal(tensors: Sequence[TensorFacts]) -> str | None:
    if not tensors:
        return "adapter has no tensors"
    for t in tensors:
        if not t.finite or not math.isfinite(t.max_abs):
            return f"{t.name}: non-finite values"
        if t.max_abs > MAX_ABS_VALUE:
            return f"{t.name}: values out of bounds (|x| > {MAX_ABS_VALUE:g})"
    return None
