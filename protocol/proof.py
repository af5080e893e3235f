"""Proof of training: the checkpoint hash chain, segment selection, catch odds, tolerance rule.

Everything a worker commits to and a verifier checks lives here; the torch side (agent/train)
only turns tensors into records and replays segments. See ipips/0005-proof-of-training.md.

Rules of this file:
- Hashes are raw 32-byte SHA-256 digests (hex in JSON files). Every hash is domain-separated by
  a constant ``b"infernet/proof/<what>/v1\\0"`` prefix so no value of one kind can pass as another.
- Integers are framed little-endian (u32 for lengths of names, u64 for everything else); a float
  (the loss) is IEEE-754 binary64 little-endian and must be finite.
- A tensor set is hashed from ``(name, dtype, shape, raw little-endian bytes)`` records sorted by
  the UTF-8 bytes of the name; dtype strings are the safetensors ones ("F32", "BF16", ...). The
  byte length must equal ``prod(shape) * itemsize``. The hash does not depend on record order
  and an empty set has a hash (the optimizer state before step 1).
- The chain starts at ``genesis(header)``; each checkpoint appends a link binding the previous
  head, the step, the adapter hash, the optimizer-state hash, the digest of the batch indices
  used since the previous checkpoint, and the mean loss over those steps.
- Segment ``i`` is the training between checkpoint ``i-1`` (the header's initial state for
  ``i = 0``) and checkpoint ``i``. Which segments get replayed is drawn from randomness fixed
  only after the worker's final head is known (the head plus a nonce the worker cannot choose).
- Replays compare exactly when worker and verifier recorded the same environment on CPU in
  float32, and otherwise within a relative-L2 tolerance (``acceptance_tolerance``).
This module knows nothing of torch, the network or who plays which role; it raises ProofError.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Mapping, Sequence

from protocol.errors import ProofError

DOMAIN_TENSOR_SET = b"infernet/proof/tensor-set/v1\0"
DOMAIN_BATCHES = b"infernet/proof/batches/v1\0"
DOMAIN_GENESIS = b"infernet/proof/genesis/v1\0"
DOMAIN_LINK = b"infernet/proof/link/v1\0"
DOMAIN_SEGMENTS = b"infernet/proof/segments/v1\0"
# the training's randomness (IPIP-0005 §6, §6.1); named before the proof/ prefix convention, kept as is
DOMAIN_EPOCH = b"infernet/epoch/v1\0"
DOMAIN_STEP_RNG = b"infernet/step-rng/v1\0"
DOMAIN_MICRO_RNG = b"infernet/micro-rng/v1\0"
DOMAIN_LORA_A = b"infernet/lora-a/v1\0"

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

FP32_TOLERANCE = 1e-4
"""Default max relative L2 distance per tensor for float32 replays in differing environments."""
HALF_TOLERANCE = 1e-2
"""Default for bf16 training, which no environment reproduces bit for bit (fp16 is not a training dtype)."""

DETERMINISM_FIELDS = (
    "torch", "peft", "transformers", "device", "dtype", "threads",
    "cpu_capability", "mkl_cbwr", "aten_cpu_capability", "backend",
)
"""Environment fields a commitment header records; equal fields on CPU/float32 mean exact replay."""
GPU_DETERMINISM_FIELDS = ("device_class", "cuda", "micro_batch", "quantization", "bitsandbytes", "unsloth",
                          "data_parallel")
"""Fields added for GPU and data-parallel work (IPIP-0005 §8): equal when both sides leave them out, else
must match. ``data_parallel`` (processes, recorded only when > 1) never matches a one-process verifier:
the ranks' gradient sums change the float summation order, so its replay is judged within tolerance."""

MAX_NAME_BYTES = 1024
MAX_NDIM = 16


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _u64(n: int) -> bytes:
    if not 0 <= n < 1 << 64:
        raise ProofError(f"integer {n} out of u64 range")
    return struct.pack("<Q", n)


def _f64(x: float) -> bytes:
    if not math.isfinite(x):
        raise ProofError(f"loss {x!r} is not a finite number")
    return struct.pack("<d", float(x))


def _digest(value: bytes, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != 32:
        raise ProofError(f"{what} must be a 32-byte digest")
    return bytes(value)


# --- tensor sets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as the proof sees it: name, safetensors dtype string, shape, little-endian bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)


def tensor_set_hash(records: Iterable[TensorRecord]) -> bytes:
    """SHA-256 of a set of named tensors, independent of the order the records come in."""
    by_name: dict[bytes, TensorRecord] = {}
    for record in records:
        name = record.name.encode("utf-8")
        if not name or len(name) > MAX_NAME_BYTES:
            raise ProofError(f"tensor name {record.name!r} is empty or longer than {MAX_NAME_BYTES} bytes")
        if name in by_name:
            raise ProofError(f"tensor {record.name!r} appears twice")
        by_name[name] = record
    h = hashlib.sha256(DOMAIN_TENSOR_SET)
    h.update(_u64(len(by_name)))
    for name in sorted(by_name):
        record = by_name[name]
        size = DTYPE_SIZES.get(record.dtype)
        if size is None:
            raise ProofError(f"tensor {record.name!r}: unknown dtype {record.dtype!r}")
        if len(record.shape) > MAX_NDIM or any(d < 0 for d in record.shape):
            raise ProofError(f"tensor {record.name!r}: bad shape {record.shape}")
        expected = math.prod(record.shape) * size
        if len(record.data) != expected:
            raise ProofError(
                f"tensor {record.name!r}: {len(record.data)} bytes, shape {record.shape} "
                f"{record.dtype} needs {expected}"
            )
        dtype = record.dtype.encode("ascii")
        h.update(_u32(len(name)) + name + _u32(len(dtype)) + dtype + _u32(len(record.shape)))
        for dim in record.shape:
            h.update(_u64(dim))
        h.update(_u64(len(record.data)))
        h.update(record.data)
    return h.digest()


EMPTY_TENSOR_SET = tensor_set_hash(())


def batches_digest(steps: Sequence[Sequence[int]]) -> bytes:
    """Digest of the sample indices each optimizer step consumed, step by step, in order."""
    h = hashlib.sha256(DOMAIN_BATCHES)
    h.update(_u64(len(steps)))
    for indices in steps:
        h.update(_u64(len(indices)))
        for index in indices:
            h.update(_u64(index))
    return h.digest()


# --- the chain ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommitmentHeader:
    """What a proof is about; its hash is the chain's genesis, so every link is bound to it."""

    job_id: bytes
    round: int
    shard: int
    attempt: int
    worker: str
    base_model_sha256: str
    seed: int
    checkpoint_every: int
    initial_adapter_hash: bytes
    environment: Mapping[str, str | int]
    # the AdamW state training starts from: none (a fresh optimizer) unless the job carries the
    # state across rounds (IPIP-0006 §2.3); written into the header only when not empty, so the
    # headers (and genesis hashes) of fresh-optimizer proofs are what they always were
    initial_optimizer_hash: bytes = EMPTY_TENSOR_SET

    def to_json(self) -> dict:
        out = {
            "job_id": self.job_id.hex(), "round": self.round, "shard": self.shard,
            "attempt": self.attempt, "worker": self.worker,
            "base_model_sha256": self.base_model_sha256, "seed": self.seed,
            "checkpoint_every": self.checkpoint_every,
            "initial_adapter_hash": self.initial_adapter_hash.hex(),
            "environment": dict(sorted(self.environment.items())),
        }
        if self.initial_optimizer_hash != EMPTY_TENSOR_SET:
            out["initial_optimizer_hash"] = self.initial_optimizer_hash.hex()
        return out

    @classmethod
    def from_json(cls, obj: Mapping) -> "CommitmentHeader":
        try:
            header = cls(
                job_id=bytes.fromhex(obj["job_id"]), round=int(obj["round"]), shard=int(obj["shard"]),
                attempt=int(obj["attempt"]), worker=str(obj["worker"]),
                base_model_sha256=str(obj["base_model_sha256"]), seed=int(obj["seed"]),
                checkpoint_every=int(obj["checkpoint_every"]),
                initial_adapter_hash=bytes.fromhex(obj["initial_adapter_hash"]),
                environment={str(k): v for k, v in dict(obj["environment"]).items()},
                initial_optimizer_hash=bytes.fromhex(obj.get("initial_optimizer_hash", EMPTY_TENSOR_SET.hex())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProofError(f"commitment header: bad or missing field ({exc})") from None
        header.genesis()
        return header

    def genesis(self) -> bytes:
        """The chain's first head: SHA-256 of the header as canonical JSON (sorted keys, no spaces)."""
        _digest(self.job_id, "header.job_id")
        _digest(self.initial_adapter_hash, "header.initial_adapter_hash")
        _digest(self.initial_optimizer_hash, "header.initial_optimizer_hash")
        if self.checkpoint_every < 1:
            raise ProofError("header.checkpoint_every must be at least 1")
        for key, value in self.environment.items():
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise ProofError(f"header.environment.{key} must be a string or an integer")
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(DOMAIN_GENESIS + text.encode("ascii")).digest()


@dataclass(frozen=True)
class ChainLink:
    """One checkpoint's commitment: the state after ``step`` optimizer steps."""

    step: int
    adapter_hash: bytes
    optimizer_hash: bytes
    batches_digest: bytes
    loss: float

    def extend(self, previous_head: bytes) -> bytes:
        """The head after this link: H(previous head, step, adapter, optimizer, batches, loss)."""
        return hashlib.sha256(
            DOMAIN_LINK
            + _digest(previous_head, "previous head")
            + _u64(self.step)
            + _digest(self.adapter_hash, "adapter_hash")
            + _digest(self.optimizer_hash, "optimizer_hash")
            + _digest(self.batches_digest, "batches_digest")
            + _f64(self.loss)
        ).digest()

    def to_json(self) -> dict:
        return {
            "step": self.step, "adapter_hash": self.adapter_hash.hex(),
            "optimizer_hash": self.optimizer_hash.hex(),
            "batches_digest": self.batches_digest.hex(), "loss": self.loss,
        }

    @classmethod
    def from_json(cls, obj: Mapping) -> "ChainLink":
        try:
            return cls(
                step=int(obj["step"]), adapter_hash=bytes.fromhex(obj["adapter_hash"]),
                optimizer_hash=bytes.fromhex(obj["optimizer_hash"]),
                batches_digest=bytes.fromhex(obj["batches_digest"]), loss=float(obj["loss"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProofError(f"chain link: bad or missing field ({exc})") from None


def chain_heads(genesis: bytes, links: Sequence[ChainLink]) -> list[bytes]:
    """The head after each link, starting from ``genesis``."""
    heads = []
    head = _digest(genesis, "genesis")
    for link in links:
        head = link.extend(head)
        heads.append(head)
    return heads


@dataclass(frozen=True)
class Commitment:
    """A worker's whole proof for one shard attempt: the header and the links, in order."""

    header: CommitmentHeader
    links: tuple[ChainLink, ...]

    @property
    def head(self) -> bytes:
        heads = chain_heads(self.header.genesis(), self.links)
        return heads[-1] if heads else self.header.genesis()

    def check(self, claimed_head: bytes | None = None) -> None:
        """Raise ProofError unless steps rise on the checkpoint grid and the head is the claimed one."""
        every = self.header.checkpoint_every
        previous = 0
        for index, link in enumerate(self.links):
            if link.step <= previous:
                raise ProofError(f"link {index}: step {link.step} does not follow step {previous}")
            last = index == len(self.links) - 1
            if not last and link.step % every:
                raise ProofError(f"link {index}: step {link.step} is off the checkpoint grid of {every}")
            if link.step - previous > every:
                raise ProofError(f"link {index}: segment {previous}..{link.step} skips a checkpoint")
            previous = link.step
        if claimed_head is not None and self.head != claimed_head:
            raise ProofError("chain head does not match the links")

    def segment_start(self, index: int) -> tuple[int, bytes, bytes]:
        """(step, adapter hash, optimizer hash) a replay of segment ``index`` starts from."""
        if not 0 <= index < len(self.links):
            raise ProofError(f"segment {index} out of range (0..{len(self.links) - 1})")
        if index == 0:
            return 0, self.header.initial_adapter_hash, self.header.initial_optimizer_hash
        before = self.links[index - 1]
        return before.step, before.adapter_hash, before.optimizer_hash

    def to_json(self) -> dict:
        return {"header": self.header.to_json(), "links": [link.to_json() for link in self.links],
                "head": self.head.hex()}

    @classmethod
    def from_json(cls, obj: Mapping) -> "Commitment":
        try:
            links = tuple(ChainLink.from_json(link) for link in obj["links"])
            commitment = cls(CommitmentHeader.from_json(obj["header"]), links)
            claimed = bytes.fromhex(obj["head"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProofError(f"commitment: bad or missing field ({exc})") from None
        commitment.check(claimed)
        return commitment


# --- how many checkpoints an attempt commits (IPIP-0004 §5.2) --------------------------------------

CHECKPOINT_MARGIN = 2
"""Checkpoint commits an attempt may make beyond what its steps need (a commit published twice)."""


def shard_steps(max_steps: int, epochs: int, examples: int, samples_per_step: int) -> int:
    """Optimizer steps one attempt on a shard of ``examples`` trains: ``max_steps`` when set (> 0),
    else ``epochs`` passes over the examples, rounded up; at least 1."""
    if max_steps > 0:
        return max_steps
    return max(1, -(-max(epochs, 1) * max(examples, 0) // max(samples_per_step, 1)))


def checkpoint_cap(steps: int, checkpoint_every: int) -> int:
    """Checkpoint commits one attempt of ``steps`` optimizer steps may make: one every
    ``checkpoint_every`` steps and one after the last (``ceil(steps / checkpoint_every)`` in all),
    plus ``CHECKPOINT_MARGIN``. More are refused: they could only keep a lease alive or fill stores."""
    return -(-max(steps, 1) // max(checkpoint_every, 1)) + CHECKPOINT_MARGIN


def max_checkpoints(terms) -> int:
    """Checkpoint commits one attempt of a job with ``terms`` (protocol/messages.JobTerms) may make
    (IPIP-0004 §5.2): what the largest shard's steps need at the terms' ``checkpoint_every``, plus the
    margin (``checkpoint_cap``). The same on every mirror: read off the signed terms alone."""
    t = terms.training
    longest = max((t.max_steps, *t.first_round_steps)) if t.max_steps else 0  # the longest round's (schedule.round_steps)
    return max(checkpoint_cap(shard_steps(longest, t.epochs, ref.records,
                                          t.batch_size * t.gradient_accumulation_steps),
                              terms.proof.checkpoint_every) for ref in terms.shards)


# --- the training's randomness (IPIP-0005 §6) -----------------------------------------------------
# A replay lands on the worker's bits only if both sides draw the same samples, dropout masks and
# initial LoRA A; these rules fix them from the header's seed alone. ipips/vectors/proof-randomness.json.


def epoch_order(n_examples: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The permutation of a shard's ``n_examples`` examples for one epoch: indices sorted by
    SHA-256(domain || u64 seed || u64 epoch || u64 index)."""
    if not 0 <= n_examples <= 1 << 32:
        raise ProofError(f"epoch order of {n_examples} examples: need 0 to 2^32")
    prefix = DOMAIN_EPOCH + _u64(seed) + _u64(epoch)
    return tuple(sorted(range(n_examples), key=lambda i: hashlib.sha256(prefix + _u64(i)).digest()))


def _seed63(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_seed(seed: int, step: int) -> int:
    """``torch.manual_seed`` before optimizer step ``step`` (0-based, counted over the whole job)."""
    return _seed63(hashlib.sha256(DOMAIN_STEP_RNG + _u64(seed) + _u64(step)).digest())


def micro_seed(seed: int, step: int, micro: int) -> int:
    """``torch.manual_seed`` before micro-batch ``micro`` of step ``step`` in a data-parallel header (§6.1)."""
    return _seed63(hashlib.sha256(DOMAIN_MICRO_RNG + _u64(seed) + _u64(step) + _u64(micro)).digest())


def lora_a_seed(seed: int, module_name: str) -> int:
    """Seed of the CPU generator that draws LoRA A of module ``module_name`` (peft name without the
    adapter name): the first 8 digest bytes little-endian, all 64 bits."""
    name = module_name.encode("utf-8")
    if not name or len(name) > MAX_NAME_BYTES:
        raise ProofError(f"module name must be 1 to {MAX_NAME_BYTES} UTF-8 bytes")
    return int.from_bytes(hashlib.sha256(DOMAIN_LORA_A + _u64(seed) + name).digest()[:8], "little")


# --- which segments to replay -------------------------------------------------------------------


def segment_selection_seed(final_head: bytes, nonce: bytes) -> bytes:
    """Seed fixed only after the worker committed: H(domain, final head, verifier's nonce or beacon)."""
    return hashlib.sha256(
        DOMAIN_SEGMENTS + _digest(final_head, "final head") + _u32(len(nonce)) + bytes(nonce)
    ).digest()


def select_segments(seed: bytes, n_segments: int, k: int) -> tuple[int, ...]:
    """``min(k, n)`` distinct segment indices in ``range(n)``, sorted, drawn uniformly from ``seed``.

    A partial Fisher-Yates shuffle; each draw in ``range(m)`` takes the next 8 bytes of the
    stream ``SHA-256(seed || u64 counter)`` as a little-endian integer and rejects values at or
    above the largest multiple of ``m`` below 2**64, so there is no modulo bias.
    """
    _digest(seed, "selection seed")
    if n_segments < 0 or k < 0:
        raise ProofError("segment counts must not be negative")
    pool = list(range(n_segments))
    counter = 0

    def below(m: int) -> int:
        nonlocal counter
        limit = (1 << 64) - (1 << 64) % m
        while True:
            x = int.from_bytes(hashlib.sha256(seed + _u64(counter)).digest()[:8], "little")
            counter += 1
            if x < limit:
                return x % m

    for j in range(min(k, n_segments)):
        r = j + below(n_segments - j)
        pool[j], pool[r] = pool[r], pool[j]
    return tuple(sorted(pool[: min(k, n_segments)]))


def faked_segments(n_segments: int, fraction: float) -> int:
    """m = ceil(f n), with f read as the decimal it was written as (0.1 * 30 is 3, not 4)."""
    if not 0 <= fraction <= 1:
        raise ProofError(f"faked fraction {fraction} outside [0, 1]")
    return math.ceil(Fraction(repr(float(fraction))) * n_segments)


def catch_probability(n_segments: int, k_checked: int, m_faked: int) -> float:
    """Chance that ``k`` distinct random segments out of ``n`` include one of ``m`` faked ones.

    Hypergeometric: ``1 - C(n - m, k) / C(n, k)``; exact for a worker who fakes whole segments
    and is caught whenever a replay lands on one.
    """
    if not 0 <= m_faked <= n_segments or k_checked < 0:
        raise ProofError(f"bad counts n={n_segments} k={k_checked} m={m_faked}")
    k = min(k_checked, n_segments)
    if n_segments == 0:
        return 0.0
    return 1.0 - math.comb(n_segments - m_faked, k) / math.comb(n_segments, k)


# --- the acceptance rule ------------------------------------------------------------------------


def environments_match(worker: Mapping[str, str | int], verifier: Mapping[str, str | int]) -> bool:
    """True when every determinism field is recorded by both and equal."""
    return all(
        key in worker and key in verifier and worker[key] == verifier[key]
        for key in DETERMINISM_FIELDS
    ) and all(worker.get(key) == verifier.get(key) for key in GPU_DETERMINISM_FIELDS)


def acceptance_tolerance(
    worker: Mapping[str, str | int],
    verifier: Mapping[str, str | int],
    spec_tolerance: float | None = None,
) -> float:
    """Max relative L2 distance a replayed tensor may have; 0.0 means hashes must match exactly.

    Exact when both sides ran float32 on CPU in the same recorded environment (that replays bit
    for bit). Otherwise the job's ``proof.tolerance`` if set, else FP32_TOLERANCE for float32
    and HALF_TOLERANCE for bf16.
    """
    dtype = worker.get("dtype")
    if environments_match(worker, verifier) and dtype == "float32" and worker.get("device") == "cpu":
        return 0.0
    if spec_tolerance is not None:
        if not 0 <= spec_tolerance < 1:
            raise ProofError(f"proof.tolerance {spec_tolerance} outside [0, 1)")
        return float(spec_tolerance)
    return FP32_TOLERANCE if dtype == "float32" else HALF_TOLERANCE


@dataclass(frozen=True)
class SegmentVerdict:
    """The outcome of replaying one segment."""

    index: int
    accepted: bool
    exact: bool
    max_distance: float
    reason: str

    @property
    def needs_end(self) -> bool:
        """Not judged yet: the replay is not bit-exact, within the loss tolerance, and the end checkpoint
        that measures its distance was not given (a verifier that fetches it only when a replay needs it
        replays again with it)."""
        return self.reason == NO_END_CHECKPOINT


NO_END_CHECKPOINT = "state differs and no end checkpoint to measure the distance"


def judge_replay(
    index: int,
    committed: ChainLink,
    replayed: ChainLink,
    tolerance: float,
    distances: Mapping[str, float] | None = None,
) -> SegmentVerdict:
    """Compare a replayed segment end with the committed link.

    ``distances`` are per-tensor relative L2 distances ``|replay - committed| / |committed|`` of
    the adapter and optimizer tensors against the worker's end checkpoint (whose hashes the
    caller has checked against the committed link); needed only when hashes differ.
    """
    def verdict(accepted: bool, exact: bool, distance: float, reason: str) -> SegmentVerdict:
        return SegmentVerdict(index, accepted, exact, distance, reason)

    if replayed.step != committed.step:
        return verdict(False, False, math.inf, f"replay ended at step {replayed.step}, commitment at {committed.step}")
    if replayed.batches_digest != committed.batches_digest:
        return verdict(False, False, math.inf, "batch indices differ from the committed ones")
    same_state = (replayed.adapter_hash == committed.adapter_hash
                  and replayed.optimizer_hash == committed.optimizer_hash)
    if same_state and replayed.loss == committed.loss:
        return verdict(True, True, 0.0, "exact match")
    if tolerance == 0.0:
        what = "loss" if same_state else "adapter or optimizer state"
        return verdict(False, False, math.inf, f"replayed {what} differs; same environment requires an exact match")
    loss_distance = abs(replayed.loss - committed.loss) / max(abs(committed.loss), 1e-12)
    if loss_distance > tolerance:
        return verdict(False, False, loss_distance, f"loss {replayed.loss:.6g} vs committed {committed.loss:.6g}")
    if same_state:
        return verdict(True, False, loss_distance, "state matches exactly, loss within tolerance")
    if not distances:
        return verdict(False, False, math.inf, NO_END_CHECKPOINT)
    name, worst = max(distances.items(), key=lambda item: item[1])
    if not worst <= tolerance:
        return verdict(False, False, worst, f"tensor {name} at relative L2 {worst:.3g} > {tolerance:.3g}")
    return verdict(True, False, worst, f"within tolerance {tolerance:.3g} (max {worst:.3g} at {name})")
