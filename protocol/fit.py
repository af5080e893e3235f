"""Does a peer's signed capability fit a job? The rules a worker, a coordinator and every election read.

Rules of this file:
- Pure: a ``Capability`` (protocol/messages.py) and the job's ``JobTerms`` in, reasons out. No torch,
  no I/O: a GPU's presence is whatever the capability declares, so the same rule runs on the worker
  deciding for itself and on every peer judging the others.
- ``training_refusals`` lists *every* unmet requirement of training a shard, each its own line:
  the runtime must be one the peer offers (unsloth only with a CUDA device); the peer must hold the
  base model by content hash; ``min_vram_gb > 0`` needs one CUDA device whose *free* memory is at
  least that (training runs on one device; memory on several does not add up).
- ``lease_refusals`` is what a coordinator checks before it grants a lease (IPIP-0004 §5.1): the
  claimant's latest signed capability must exist, say it accepts training, and meet
  ``training_refusals``' requirements, except that the VRAM rule reads each device's *total* memory:
  the free memory a capability carries is a snapshot that lags (taken while the claimant still
  trained its previous shard), and the claimant checked its free memory itself before it claimed.
- ``replay_refusals`` is what a verifier needs to replay a segment (IPIP-0005 §8, IPIP-0006 §1.2):
  the base model by hash; for ``min_vram_gb > 0`` or ``runtime: unsloth`` a CUDA device whose *total*
  memory is at least ``min_vram_gb`` (total, not free: eligibility must not flicker while the peer
  trains, or views of the election would differ). A CPU replay of GPU-sized work is not offered. An
  unsloth job's verifier must offer unsloth itself: unsloth replays its own segments exactly on the
  same GPU class, where peft replaying them drifted 1.7 % (> the 1 % tolerance) on an H200 (issue 22).
- An empty list means the peer fits. Reasons are one line each, naming the number that failed.
- ``full_size_refusal`` is the size rule of ``method: full`` (IPIP-0007): a base model of more than
  ``FULL_MAX_PARAMETERS`` parameters is not fully fine-tuned; the submitter, a local run and a worker
  each apply it to the parameters of their own copy of the model.
"""

from __future__ import annotations

from protocol.messages import FULL_MAX_PARAMETERS, Capability, JobTerms

GPU_RUNTIMES = frozenset({"unsloth"})


def cuda_devices(cap: Capability) -> tuple:
    return tuple(d for d in cap.devices if d.kind == "cuda")


def holds_model(cap: Capability, sha256: bytes) -> bool:
    return any(model.sha256 == sha256 for model in cap.models)


def _model_reason(terms: JobTerms) -> str:
    return (f"base model {terms.base_model!r} (sha256 {terms.base_model_sha256.hex()[:16]}…) "
            "is not among the models this agent holds")


def training_refusals(cap: Capability, terms: JobTerms) -> list[str]:
    """Every reason this peer cannot train a shard of the job (empty: it can)."""
    return _training_refusals(cap, terms, free=True)


def lease_refusals(cap: Capability | None, terms: JobTerms) -> list[str]:
    """Every reason a coordinator refuses a lease of the job to this claimant (empty: it may grant it)."""
    if cap is None:
        return ["no signed capability has been heard from this peer"]
    reasons = [] if cap.accepts_training else ["its capability says it does not accept training"]
    return reasons + _training_refusals(cap, terms, free=False)


def _training_refusals(cap: Capability, terms: JobTerms, *, free: bool) -> list[str]:
    reasons = []
    gpus = cuda_devices(cap)
    if terms.runtime not in cap.backends:
        if terms.runtime in GPU_RUNTIMES and not gpus:
            reasons.append(f"runtime {terms.runtime} needs a CUDA GPU; this agent has none")
        else:
            reasons.append(f"runtime {terms.runtime} is not offered here (offers: {', '.join(cap.backends) or 'none'})")
    if not holds_model(cap, terms.base_model_sha256):
        reasons.append(_model_reason(terms))
    if terms.min_vram_gb > 0:
        if not gpus:
            reasons.append(f"job needs {terms.min_vram_gb:g} GB of VRAM; this agent has no GPU")
        elif free:
            best = max(gpus, key=lambda d: d.vram_free_gb)
            if best.vram_free_gb < terms.min_vram_gb:
                reasons.append(f"job needs {terms.min_vram_gb:g} GB of free VRAM on one GPU; the most free "
                               f"here is {best.vram_free_gb:.1f} GB (cuda:{best.index} {best.name})")
        else:
            best = max(gpus, key=lambda d: d.vram_total_gb)
            if best.vram_total_gb < terms.min_vram_gb:
                reasons.append(f"job needs {terms.min_vram_gb:g} GB of VRAM on one GPU; the largest here has "
                               f"{best.vram_total_gb:.1f} GB (cuda:{best.index} {best.name})")
    return reasons


def replay_refusals(cap: Capability, terms: JobTerms) -> list[str]:
    """Every reason this peer cannot replay a segment of the job (empty: it can verify it)."""
    reasons = []
    if not holds_model(cap, terms.base_model_sha256):
        reasons.append(_model_reason(terms))
    if terms.min_vram_gb > 0 or terms.runtime in GPU_RUNTIMES:
        gpus = cuda_devices(cap)
        need = f"{terms.min_vram_gb:g} GB" if terms.min_vram_gb > 0 else f"runtime {terms.runtime}"
        if not gpus:
            reasons.append(f"replaying this job needs a CUDA GPU ({need}); this agent has none")
        elif max(d.vram_total_gb for d in gpus) < terms.min_vram_gb:
            reasons.append(f"replaying this job needs {terms.min_vram_gb:g} GB of VRAM on one GPU; the largest "
                           f"here has {max(d.vram_total_gb for d in gpus):.1f} GB")
    if terms.runtime in GPU_RUNTIMES and terms.runtime not in cap.backends:
        reasons.append(f"replaying this job needs runtime {terms.runtime} (peft's kernels drift from it past the "
                       f"tolerance); this agent offers {', '.join(cap.backends) or 'none'}")
    return reasons


def full_size_refusal(parameters: int) -> str | None:
    """Why a base model of ``parameters`` parameters may not be fully fine-tuned (None: it may)."""
    if parameters <= FULL_MAX_PARAMETERS:
        return None
    return (f"method full: the base model has {parameters / 1e6:.0f}M parameters, more than the "
            f"{FULL_MAX_PARAMETERS / 1e6:.0f}M full fine-tuning allows (its weights and AdamW state must fit a "
            "1 GiB bundle); use method lora")
