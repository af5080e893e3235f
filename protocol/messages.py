"""The messages of the protocol and the gossip topics they travel on.

Rules of this file:
- Every message is a frozen dataclass with a ``TYPE`` tag. Its wire form (``to_wire``) is a map of
  its field names to values, nested dataclasses as maps, tuples as lists; the envelope signs the
  canonical msgpack of that map (protocol/codec.py, protocol/envelope.py).
- ``from_wire`` is strict: a missing, extra or wrongly typed field is a CodecError naming the field
  path; so are values outside their bounds (string and list lengths, non-negative counts, finite
  numbers, CIDs that do not parse, peer IDs that do not embed an Ed25519 key, 32-byte digests).
  ``bool`` is never accepted for an int, nor int for a float: the canonical encoding keeps them apart.
- Extension fields (``extension_field``), added after a message first shipped, are left out of the
  wire map while they hold their default, so terms that do not use them encode (and hash to a job
  ID) exactly as before; a decoder fills the default in for an absent one and refuses one present
  at its default (it would be a second encoding of the same value).
- A job's ID is ``sha256(b"infernet/job/v1\\x00" + canonical_encode(terms.to_wire()))``: it names the
  exact terms, and ``JobAnnouncement.from_wire`` rejects an announcement whose ID does not match.
- Topics: announcements, capabilities, heartbeats and cancels go on ``TOPIC_JOBS``; everything about
  one job's shards goes on ``job_topic(job_id)``. ``MESSAGE_TOPICS`` says which kind each type uses.

See ipips/0002-messages-topics.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from protocol.cid import parse_cid
from protocol.codec import canonical_encode
from protocol.errors import CIDError, CodecError, KeyFileError
from protocol.identity import public_key_from_peer_id
from protocol.schedule import INNER_SCHEDULES  # the rate within a round (IPIP-0006 §2.5)

TOPIC_JOBS = "infernet/v1/jobs"
JOB_TOPIC_PREFIX = "infernet/v1/job/"
JOB_ID_DOMAIN = b"infernet/job/v1\x00"

MAX_STR = 256
MAX_TEXT = 4096
MAX_LIST = 1024
MAX_MAP = 64

AGGREGATION_METHODS = ("fedavg", "exact", "svd", "median", "trimmed_mean")
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov", "adam")
OUTER_METHODS = ("fedavg", "exact")  # the rules whose mean lives in the adapters' own coordinates
LR_SCHEDULES = ("constant", "cosine")
OPTIMIZER_STATES = ("fresh", "carried")
REPORT_CODECS = ("none", "int8", "int4", "int4-log", "int4-fresh")  # how a report carries its round's end state (IPIP-0006 §2.8)
OBJECTIVES = ("sft", "dpo")  # what a step's loss is (IPIP-0005 §6.2)
TRAINING_METHODS = ("lora", "qlora", "full")  # full: every weight of the base model trains (IPIP-0007 "method")
FULL_AGGREGATIONS = ("fedavg", "median", "trimmed_mean")  # exact and svd are rules for LoRA factors
# the largest base model a full fine-tuning job may name: its weights and carried AdamW moments in float32
# (12 bytes a parameter) fit the 1 GiB a report, checkpoint or aggregate bundle may hold (IPIP-0003 §3)
FULL_MAX_PARAMETERS = 80_000_000
MAX_DPO_BETA = 100.0
MAX_FIRST_ROUNDS = 64  # training.first_round_steps: the rounds it may name


class ShardAttempt(typing.NamedTuple):
    """One attempt at one shard of one round: the key of a job's leases, checkpoints, reports and verdicts
    (a tuple, so ``(round, shard, attempt)`` finds the same entry)."""

    round: int
    shard: int
    attempt: int


def attempt_of(item: Any) -> ShardAttempt:
    """The attempt a message or a state-machine action with ``round``, ``shard`` and ``attempt`` is about."""
    return ShardAttempt(item.round, item.shard, item.attempt)


def job_topic(job_id: bytes) -> str:
    """The per-job topic carrying claims, leases, commitments, reports, verdicts and aggregates."""
    return JOB_TOPIC_PREFIX + job_id.hex()


# -- field constraints -------------------------------------------------------------------------------

def _meta(kind: str | None = None, **kw: Any) -> dict[str, Any]:
    return {"kind": kind, **kw}


def cid_field() -> Any:
    return field(metadata=_meta("cid"))


def peer_field() -> Any:
    return field(metadata=_meta("peer"))


def digest_field() -> Any:
    return field(metadata=_meta("digest"))


def count_field(maximum: int = 2**53) -> Any:
    return field(metadata=_meta("count", maximum=maximum))


def enum_field(*choices: str) -> Any:
    return field(metadata=_meta("enum", choices=choices))


def text_field(max_len: int = MAX_TEXT) -> Any:
    return field(metadata=_meta("text", max_len=max_len))


def extension_field(default: Any, kind: str | None = None, **kw: Any) -> Any:
    """A field added later: absent from the wire while it equals ``default`` (module docstring)."""
    return field(default=default, metadata=_meta(kind, extension=True, **kw))


def _check_scalar(value: Any, meta: dict[str, Any], path: str) -> None:
    kind = meta.get("kind")
    if kind == "cid":
        try:
            parse_cid(value)
        except CIDError as exc:
            raise CodecError("bad-field", f"{path}: {exc}") from None
    elif kind == "peer":
        try:
            public_key_from_peer_id(value)
        except KeyFileError:
            raise CodecError("bad-field", f"{path}: not an Ed25519 peer ID: {value[:60]!r}") from None
    elif kind == "digest":
        if len(value) != 32:
            raise CodecError("bad-field", f"{path}: expected a 32-byte digest, got {len(value)} bytes")
    elif kind == "count":
        if not 0 <= value <= meta["maximum"]:
            raise CodecError("bad-field", f"{path}: expected 0..{meta['maximum']}, got {value}")
    elif kind == "enum":
        if value not in meta["choices"]:
            raise CodecError("bad-field", f"{path}: expected one of {', '.join(meta['choices'])}, got {value!r}")


# -- generic strict conversion -----------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _from_value(tp: Any, value: Any, meta: dict[str, Any], path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _from_value(args[0], value, meta, path)
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise CodecError("bad-field", f"{path}: expected a list")
        if len(value) > meta.get("max_len", MAX_LIST):
            raise CodecError("bad-field", f"{path}: more than {meta.get('max_len', MAX_LIST)} items")
        return tuple(_from_value(item_tp, v, meta, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise CodecError("bad-field", f"{path}: expected a map")
        if len(value) > MAX_MAP:
            raise CodecError("bad-field", f"{path}: more than {MAX_MAP} entries")
        out = {}
        for k, v in value.items():
            if len(k) > MAX_STR:
                raise CodecError("bad-field", f"{path}: key longer than {MAX_STR}")
            out[k] = _from_value(val_tp, v, {}, f"{path}.{k}")
        return out
    if dataclasses.is_dataclass(tp):
        return _from_map(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise CodecError("bad-field", f"{path}: expected a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise CodecError("bad-field", f"{path}: expected an integer, got {type(value).__name__}")
    elif tp is float:
        if not isinstance(value, float) or not math.isfinite(value):
            raise CodecError("bad-field", f"{path}: expected a finite float, got {type(value).__name__}")
    elif tp is str:
        if not isinstance(value, str):
            raise CodecError("bad-field", f"{path}: expected a string, got {type(value).__name__}")
        limit = meta.get("max_len", MAX_STR)
        if len(value) > limit:
            raise CodecError("bad-field", f"{path}: string longer than {limit}")
    elif tp is bytes:
        if not isinstance(value, bytes):
            raise CodecError("bad-field", f"{path}: expected bytes, got {type(value).__name__}")
        if len(value) > meta.get("max_len", MAX_STR):
            raise CodecError("bad-field", f"{path}: bytes longer than {meta.get('max_len', MAX_STR)}")
    else:  # pragma: no cover - a schema bug, not bad input
        raise TypeError(f"unsupported field type {tp!r}")
    _check_scalar(value, meta, path)
    return value


def _from_map(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise CodecError("bad-field", f"{path or cls.__name__}: expected a map")
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    extra = sorted(set(value) - names)
    if extra:
        raise CodecError("bad-field", f"{_join(path, extra[0])}: unknown field")
    kwargs = {}
    for f in fields:
        if f.name not in value:
            if f.metadata.get("extension"):
                continue  # its default
            raise CodecError("bad-field", f"{_join(path, f.name)}: missing field")
        kwargs[f.name] = _from_value(hints[f.name], value[f.name], dict(f.metadata), _join(path, f.name))
        if f.metadata.get("extension") and kwargs[f.name] == f.default:
            raise CodecError("bad-field", f"{_join(path, f.name)}: holds its default; leave it out")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path or cls.__name__)
    return obj


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _to_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_value(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("extension") and getattr(value, f.name) == f.default)}
    if isinstance(value, (tuple, list)):
        return [_to_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_value(v) for k, v in value.items()}
    return value


class Wire:
    """Mixin: strict conversion to and from the wire map."""

    def to_wire(self) -> dict[str, Any]:
        return _to_value(self)

    @classmethod
    def from_wire(cls, value: Any, path: str = ""):
        return _from_map(cls, value, path)


def _float_fields(cls):
    """Coerce ints given for float fields at construction (``lr=1`` → ``1.0``): keeps the wire canonical."""
    hints = typing.get_type_hints(cls)
    floats = [n for n, t in hints.items() if t is float or t == Optional[float]]
    original = cls.__post_init__ if hasattr(cls, "__post_init__") else None

    def __post_init__(self):
        for name in floats:
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, name, float(v))
        if original is not None:
            original(self)

    cls.__post_init__ = __post_init__
    return cls


def message(type_tag: str, topic: str):
    """Register a message class under its wire type tag and topic kind ("jobs" or "job")."""

    def wrap(cls):
        cls = dataclass(frozen=True)(_float_fields(cls))
        cls.TYPE = type_tag
        MESSAGE_TYPES[type_tag] = cls
        MESSAGE_TOPICS[type_tag] = topic
        return cls

    return wrap


def record(cls):
    return dataclass(frozen=True)(_float_fields(cls))


MESSAGE_TYPES: dict[str, type] = {}
MESSAGE_TOPICS: dict[str, str] = {}


# -- job terms ---------------------------------------------------------------------------------------

@record
class ShardRef(Wire):
    index: int = count_field(MAX_LIST)
    cid: str = cid_field()
    records: int = count_field()
    size: int = count_field()


@record
class TrainingTerms(Wire):
    epochs: int = count_field(10_000)
    learning_rate: float = field()
    batch_size: int = count_field(65_536)
    gradient_accumulation_steps: int = count_field(65_536)
    max_seq_len: int = count_field(1 << 20)
    max_steps: int = count_field()
    # the inner learning rate across rounds (IPIP-0006 §2.5; protocol/schedule.py)
    schedule: str = extension_field("constant", "enum", choices=LR_SCHEDULES)
    warmup_rounds: int = extension_field(0, "count", maximum=1000)
    # where a round's AdamW starts: afresh, or from the accepted workers' averaged state that the
    # previous aggregate carries (IPIP-0006 §2.3)
    optimizer_state: str = extension_field("fresh", "enum", choices=OPTIMIZER_STATES)
    # how a report carries the round's end state: whole tensors, or int8-coded deltas (IPIP-0006 §2.8)
    report_codec: str = extension_field("none", "enum", choices=REPORT_CODECS)
    # the rate within a round: constant, or a warm-up and a decay (IPIP-0006 §2.5; protocol/schedule.py)
    inner_schedule: str = extension_field("constant", "enum", choices=INNER_SCHEDULES)
    # examples concatenated into sequences of max_seq_len tokens (IPIP-0007): what a step's samples are
    packing: bool = extension_field(False)
    # what a step's loss is: supervised (sft) on ChatML, or DPO on preference pairs (IPIP-0005 §6.2),
    # with DPO's beta
    objective: str = extension_field("sft", "enum", choices=OBJECTIVES)
    dpo_beta: float = extension_field(0.1)
    # how a round's aggregate travels to the next round's workers: whole, or as an update through the same
    # codec from the round's start, the aggregate then being that update's decoded state (IPIP-0006 §2.8.1;
    # protocol/downlink.py)
    aggregate_codec: str = extension_field("none", "enum", choices=REPORT_CODECS)
    # the steps of the job's first rounds, shorter than max_steps: a few quick averages while the adapter moves
    # most (IPIP-0006 §2.5; protocol/schedule.round_steps)
    first_round_steps: tuple[int, ...] = extension_field((), "count", maximum=2**53, max_len=MAX_FIRST_ROUNDS)

    def check(self, path: str) -> None:
        if self.first_round_steps and self.max_steps == 0:
            raise CodecError("bad-field", f"{path}.first_round_steps: needs max_steps (the steps of the rounds "
                             "after them)")
        for index, steps in enumerate(self.first_round_steps):
            if steps < 1:
                raise CodecError("bad-field", f"{path}.first_round_steps[{index}]: expected at least 1 step")
        if not 0.0 < self.dpo_beta <= MAX_DPO_BETA:
            raise CodecError("bad-field", f"{path}.dpo_beta: expected (0, {MAX_DPO_BETA:g}]")
        if self.packing and self.objective != "sft":
            raise CodecError("bad-field", f"{path}.packing: packs sft examples, not {self.objective} pairs")


@record
class StopTerms(Wire):
    """When a job may end before its last round (IPIP-0006 §2.6): 0 turns a condition off."""

    validation_loss_below: float = field()
    patience_rounds: int = count_field(1000)

    def check(self, path: str) -> None:
        if self.validation_loss_below < 0:
            raise CodecError("bad-field", f"{path}.validation_loss_below: expected >= 0")
        if self.validation_loss_below == 0 and self.patience_rounds == 0:
            raise CodecError("bad-field", f"{path}: no condition set; leave stop out")


@record
class OuterTerms(Wire):
    """The outer optimizer a round's aggregate is made with (IPIP-0006 §2.4)."""

    optimizer: str = enum_field(*OUTER_OPTIMIZERS)
    lr: float = field()
    momentum: float = field()
    beta1: float = field()
    beta2: float = field()

    def check(self, path: str) -> None:
        if self.optimizer == "none":
            raise CodecError("bad-field", f"{path}.optimizer: 'none' is written by leaving outer out")
        for name, low, high in (("lr", 0.0, 100.0), ("momentum", 0.0, 1.0), ("beta1", 0.0, 1.0),
                                ("beta2", 0.0, 1.0)):
            value = getattr(self, name)
            if not low <= value < high or (name == "lr" and value == 0.0):
                raise CodecError("bad-field", f"{path}.{name}: expected {'(' if name == 'lr' else '['}{low:g}, {high:g}), got {value}")


@record
class LoraTerms(Wire):
    rank: int = count_field(4096)
    alpha: float = field()
    dropout: float = field()
    target_modules: tuple[str, ...] = field(metadata=_meta(max_len=64))
    freeze_a: bool = field()


@record
class ProofTerms(Wire):
    checkpoint_every: int = count_field()
    verify_segments: int = count_field(MAX_LIST)
    tolerance: float = field()


@record
class JobTerms(Wire):
    """Everything a worker agrees to when it takes a shard. Hashing these gives the job ID."""

    name: str
    submitter: str = peer_field()
    base_model: str = text_field(MAX_STR)
    base_model_sha256: bytes = digest_field()
    method: str = enum_field(*TRAINING_METHODS)
    runtime: str = enum_field("peft", "unsloth")
    seed: int = count_field()
    shards: tuple[ShardRef, ...] = field()
    validation_cid: Optional[str] = cid_field()
    training: TrainingTerms = field()
    lora: LoraTerms = field()
    proof: ProofTerms = field()
    rounds: int = count_field(1000)
    aggregation: str = enum_field(*AGGREGATION_METHODS)
    min_accepted_fraction: float = field()
    max_retries: int = count_field(100)
    lease_seconds: int = count_field()
    min_vram_gb: float = field()
    deadline: int = count_field()
    price_per_hour: float = field()
    budget: float = field()
    created: int = count_field()
    outer: Optional[OuterTerms] = extension_field(None)
    stop: Optional[StopTerms] = extension_field(None)
    # what the job is for, in the submitter's words (IPIP-0007 "description"); informative only
    description: str = extension_field("", "text", max_len=MAX_TEXT)
    # the final aggregate is sealed to the submitter's key (ipips/0010-sealed-results.md)
    private: bool = extension_field(False)
    # the dataset the submitter sharded, when the spec named it by CID (IPIP-0007 "input.dataset")
    dataset_cid: Optional[str] = extension_field(None, "cid")
    # a Hugging Face input, as hf:NAME[@REVISION][ config=C] split=S (IPIP-0007 "input.hf"): informative;
    # the shards' CIDs are what workers train on
    dataset_source: str = extension_field("", "text", max_len=MAX_TEXT)
    # who may be leased (IPIP-0004 §12, protocol/market.py): at most this many distinct workers
    # (0: no cap), and only these peers (empty: anyone)
    max_nodes: int = extension_field(0, "count", maximum=MAX_LIST)
    providers: tuple[str, ...] = extension_field((), "peer", max_len=64)

    def check(self, path: str) -> None:
        if self.stop is not None and self.validation_cid is None:
            raise CodecError("bad-field", f"{path}.stop: stopping early needs a validation split (validation_cid)")
        if self.outer is not None and self.aggregation not in OUTER_METHODS:
            raise CodecError("bad-field", f"{path}.outer: an outer optimizer needs aggregation "
                             f"{' or '.join(OUTER_METHODS)}, not {self.aggregation}")
        if self.method == "full" and self.aggregation not in FULL_AGGREGATIONS:
            raise CodecError("bad-field", f"{path}.aggregation: full fine-tuning averages weights "
                             f"({', '.join(FULL_AGGREGATIONS)}), not {self.aggregation}")
        if self.method == "full" and self.training.aggregate_codec != "none":
            raise CodecError("bad-field", f"{path}.training.aggregate_codec: full fine-tuning's aggregate travels "
                             "whole (an update codes an adapter and its AdamW state)")
        if self.method == "full" and self.training.objective == "dpo":
            raise CodecError("bad-field", f"{path}.training.objective: dpo's reference is the base model with the "
                             "adapter disabled: it needs method lora or qlora")
        if len(self.training.first_round_steps) >= self.rounds and self.training.first_round_steps:
            raise CodecError("bad-field", f"{path}.training.first_round_steps: names {len(self.training.first_round_steps)} "
                             f"rounds of a {self.rounds}-round job; at most {self.rounds - 1}")
        if not self.shards:
            raise CodecError("bad-field", f"{path}.shards: a job needs at least one shard")
        if [s.index for s in self.shards] != list(range(len(self.shards))):
            raise CodecError("bad-field", f"{path}.shards: indices must be 0..n-1 in order")
        if not 0.0 < self.min_accepted_fraction <= 1.0:
            raise CodecError("bad-field", f"{path}.min_accepted_fraction: expected (0, 1]")
        if len(set(self.providers)) != len(self.providers):
            raise CodecError("bad-field", f"{path}.providers: a provider is named twice")

    def job_id(self) -> bytes:
        return hashlib.sha256(JOB_ID_DOMAIN + canonical_encode(self.to_wire())).digest()

    def validation_size_bound(self) -> int:
        """The most bytes the file ``validation_cid`` names may hold (IPIP-0003 §3 "Size bounds"): the
        training shards' bytes together (``ShardRef.size``). The held-out split is under half the
        records, and the submitter refuses a dataset whose split is larger than its shards."""
        return sum(s.size for s in self.shards)


# -- messages ----------------------------------------------------------------------------------------

@message("job", "jobs")
class JobAnnouncement(Wire):
    job_id: bytes = digest_field()
    terms: JobTerms = field()

    @classmethod
    def for_terms(cls, terms: JobTerms) -> "JobAnnouncement":
        return cls(terms.job_id(), terms)

    def check(self, path: str) -> None:
        if self.terms.job_id() != self.job_id:
            raise CodecError("bad-field", f"{path}.job_id: does not match the hash of the terms")


@record
class Hardware(Wire):
    device: str = enum_field("cpu", "cuda", "mps")
    device_name: str = field()
    vram_gb: float = field()
    ram_gb: float = field()
    cpu_threads: int = count_field(4096)


MAX_DEVICES = 16
MAX_MODELS = 64
MAX_VRAM_GB = 65_536.0


@record
class Device(Wire):
    """One accelerator as the agent measured it at start (free memory again at each ``cap``)."""

    kind: str = enum_field("cuda", "mps")
    index: int = count_field(MAX_DEVICES - 1)
    name: str = field()
    vram_total_gb: float = field()
    vram_free_gb: float = field()
    compute_capability: str = field(metadata=_meta(max_len=16))  # "8.0" for an A100; "" when unknown
    bf16: bool = field()

    def check(self, path: str) -> None:
        if not 0.0 <= self.vram_total_gb <= MAX_VRAM_GB:
            raise CodecError("bad-field", f"{path}.vram_total_gb: expected 0..{MAX_VRAM_GB:g}")
        if not 0.0 <= self.vram_free_gb <= self.vram_total_gb:
            raise CodecError("bad-field", f"{path}.vram_free_gb: expected 0..vram_total_gb")


@record
class ModelHeld(Wire):
    """A base model the agent holds: the name jobs use for it and its content hash (IPIP-0005 §4)."""

    name: str = text_field(MAX_STR)
    sha256: bytes = digest_field()


@record
class ModelSpeed(Wire):
    """Tokens per second this agent measured training a held base model (a short real burst, or its
    last real shard), on the device it names (IPIP-0002 §3)."""

    sha256: bytes = digest_field()
    tokens_per_s: float = field()
    device: str = field(metadata=_meta(max_len=64))

    def check(self, path: str) -> None:
        if not 0.0 < self.tokens_per_s <= 1e9:
            raise CodecError("bad-field", f"{path}.tokens_per_s: expected (0, 1e9], got {self.tokens_per_s}")


@message("cap", "jobs")
class Capability(Wire):
    """What an agent offers. ``hardware`` summarises the best device (old field, same meaning);
    ``devices`` lists every accelerator measured, ``models`` the base models held by hash."""

    hardware: Hardware = field()
    backends: tuple[str, ...] = field(metadata=_meta(max_len=16))
    price_per_hour: float = field()
    accepts_training: bool = field()
    can_coordinate: bool = field()
    max_concurrent_shards: int = count_field(1024)
    agent_version: str = field()
    cpu_model: str = field()
    devices: tuple[Device, ...] = field(metadata=_meta(max_len=MAX_DEVICES))
    models: tuple[ModelHeld, ...] = field(metadata=_meta(max_len=MAX_MODELS))
    speeds: tuple[ModelSpeed, ...] = extension_field((), max_len=MAX_MODELS)

    def check(self, path: str) -> None:
        if len({s.sha256 for s in self.speeds}) != len(self.speeds):
            raise CodecError("bad-field", f"{path}.speeds: a model is listed twice")
        if len({(d.kind, d.index) for d in self.devices}) != len(self.devices):
            raise CodecError("bad-field", f"{path}.devices: a device is listed twice")
        if not 0.0 <= self.hardware.vram_gb <= MAX_VRAM_GB or not 0.0 <= self.hardware.ram_gb:
            raise CodecError("bad-field", f"{path}.hardware: memory sizes must be non-negative")


@message("claim", "job")
class ShardClaim(Wire):
    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)


@message("lease", "job")
class ShardLease(Wire):
    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)
    attempt: int = count_field(1000)
    worker: str = peer_field()
    term: int = count_field()
    expires_at: float = field()
    initial_adapter_cid: Optional[str] = cid_field()


@message("release", "job")
class ShardRelease(Wire):
    """A worker gives a lease back: shutting down, or refusing the shard (hash mismatch, ...). ``cause``
    ``RELEASE_LOCAL``: the worker's own machine, not the shard (its disk filled, it restarted or shuts down, it
    has no room for it): the attempt is excused (IPIP-0004 §5 RETRY); any other value counts as a failed attempt."""

    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)
    attempt: int = count_field(1000)
    reason: str = text_field(1024)
    cause: Optional[str] = extension_field(None, max_len=32)


RELEASE_LOCAL = "local"
"""``ShardRelease.cause``: the worker's own machine gave out, not the shard (an excused attempt)."""


@message("revoke", "job")
class ShardRevoke(Wire):
    """The job's coordinator ends a lease whose holder it no longer hears (IPIP-0004 §5.3): no heartbeat of
    ``worker`` for ``silent_seconds`` while the other peers' still arrive. The attempt is excused; the shard
    reopens at once instead of when the lease runs out (``lease_seconds``, an hour by default)."""

    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)
    attempt: int = count_field(1000)
    worker: str = peer_field()
    term: int = count_field()
    silent_seconds: float = field()

    def check(self, path: str) -> None:
        if self.silent_seconds < 0:
            raise CodecError("bad-field", f"{path}.silent_seconds: must be >= 0, got {self.silent_seconds!r}")


@message("ckpt", "job")
class CheckpointCommit(Wire):
    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)
    attempt: int = count_field(1000)
    step: int = count_field()
    index: int = count_field()
    chain_head: bytes = digest_field()
    adapter_hash: bytes = digest_field()
    loss: float = field()
    checkpoint_cid: Optional[str] = cid_field()


@message("report", "job")
class ShardReport(Wire):
    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)
    attempt: int = count_field(1000)
    adapter_cid: str = cid_field()
    proof_cid: str = cid_field()
    chain_head: bytes = digest_field()
    checkpoints: int = count_field()
    steps: int = count_field()
    samples: int = count_field()
    final_loss: float = field()
    metrics: dict[str, float] = field()


@message("verdict", "job")
class Verdict(Wire):
    job_id: bytes = digest_field()
    round: int = count_field(1000)
    shard: int = count_field(MAX_LIST)
    attempt: int = count_field(1000)
    worker: str = peer_field()
    term: int = count_field()
    accepted: bool = field()
    reason: str = text_field(1024)
    segments_checked: tuple[int, ...] = field()


@message("aggregate", "job")
class AggregatePublished(Wire):
    job_id: bytes = digest_field()
    round: int = count_field(1000)
    term: int = count_field()
    adapter_cid: str = cid_field()
    method: str = enum_field(*AGGREGATION_METHODS)
    shards: tuple[int, ...] = field()
    samples: int = count_field()
    final: bool = field()
    # the coordinator's score of this aggregate on the job's validation split (IPIP-0006 §2.6);
    # round 1 also carries the base model's (base + the seeded initial adapter)
    validation_loss: Optional[float] = extension_field(None)
    base_validation_loss: Optional[float] = extension_field(None)
    # a DPO job's score beside its loss (IPIP-0006 §2.6): the share of validation pairs whose chosen side
    # has the larger implicit reward, and the mean reward margin
    reward_accuracy: Optional[float] = extension_field(None)
    reward_margin: Optional[float] = extension_field(None)
    # a coded aggregate's update (IPIP-0006 §2.8.1): the bundle that rebuilds ``adapter_cid`` from the round's start
    update_cid: Optional[str] = extension_field(None, "cid")

    def check(self, path: str) -> None:
        if self.reward_accuracy is not None and not 0.0 <= self.reward_accuracy <= 1.0:
            raise CodecError("bad-field", f"{path}.reward_accuracy: expected 0..1")


@message("early", "job")
class EarlyStart(Wire):
    """The coordinator's word, before it publishes round ``round - 1``'s aggregate, of what that aggregate
    will be if every report of the round passes its replay (IPIP-0006 §2.9): ``initial_adapter_cid``, the
    start of round ``round``, and which worker it will lease which shard of that round (``shards[i]`` to
    ``workers[i]``). A named worker may train its shard from that start before its lease; it announces
    nothing of it until the lease is its own and the aggregate published is that CID. A promise, not a
    change of the job: never stored by a mirror, never a lease."""

    job_id: bytes = digest_field()
    round: int = count_field(1000)
    term: int = count_field()
    initial_adapter_cid: str = cid_field()
    shards: tuple[int, ...] = field(metadata=_meta(max_len=MAX_LIST))
    workers: tuple[str, ...] = field(metadata=_meta("peer", max_len=MAX_LIST))
    # a coded aggregate's update (IPIP-0006 §2.8.1): the bundle that rebuilds ``initial_adapter_cid`` from the
    # start of round ``round - 1``
    update_cid: Optional[str] = extension_field(None, "cid")

    def check(self, path: str) -> None:
        if len(self.shards) != len(self.workers):
            raise CodecError("bad-field", f"{path}.workers: {len(self.workers)} workers for {len(self.shards)} shards")
        if len(set(self.shards)) != len(self.shards) or len(set(self.workers)) != len(self.workers):
            raise CodecError("bad-field", f"{path}.shards: a shard or a worker named twice")
        if any(not 0 <= s < MAX_LIST for s in self.shards):
            raise CodecError("bad-field", f"{path}.shards: a shard index outside 0..{MAX_LIST - 1}")
        if self.round < 2:
            raise CodecError("bad-field", f"{path}.round: an early start is of round 2 or later")


@message("cancel", "jobs")
class JobCancel(Wire):
    job_id: bytes = digest_field()
    reason: str = text_field(1024)


@record
class CoordinatorTerm(Wire):
    job_id: bytes = digest_field()
    term: int = count_field()


@message("heartbeat", "jobs")
class Heartbeat(Wire):
    seq: int = count_field()
    active_shards: int = count_field(1024)
    coordinating: tuple[CoordinatorTerm, ...] = field()


Message = typing.Union[
    JobAnnouncement, Capability, ShardClaim, ShardLease, ShardRelease, ShardRevoke, CheckpointCommit,
    ShardReport, Verdict, AggregatePublished, EarlyStart, JobCancel, Heartbeat,
]


def topic_for(msg: Any) -> str:
    """The gossip topic a message must be published on."""
    if MESSAGE_TOPICS[msg.TYPE] == "jobs":
        return TOPIC_JOBS
    return job_topic(msg.job_id)


def decode_body(type_tag: str, body: Any) -> Any:
    """Turn a verified envelope body into its message; CodecError for unknown types or bad fields."""
    cls = MESSAGE_TYPES.get(type_tag)
    if cls is None:
        raise CodecError("unknown-type", f"message type {type_tag[:40]!r}")
    return cls.from_wire(body, type_tag)
