"""The job spec, ``infernet.train.yml``: parse, validate, and give its canonical form.

Rules of this file (the document is ipips/0007-job-spec.md, the vectors ipips/vectors/jobspec-*.json):

- Every key, its type, range and default is declared once, on the dataclass field that holds it
  (``_key(default, rule)``): the parser and ``from_dict`` read that table, the tests hold the
  template and the IPIP to it; nothing else decides what a valid spec is.
- YAML is read with a ``SafeLoader`` subclass and only ever *composed* (``yaml.compose``), never
  constructed: we need each node's line for error messages, and no Python object is ever built
  from a tag. Plain scalars are typed by the YAML 1.2 core schema, not PyYAML's YAML 1.1 one, so
  ``2e-4`` is a number (PyYAML alone reads it as text) and ``no``/``on`` are text, not booleans.
  Quoted scalars are always text: ``"true"`` or ``"8"`` where a bool or int is expected is an error.
- Hostile input is bounded: at most ``MAX_SPEC_BYTES``, ``MAX_NODES`` values nested at most
  ``MAX_DEPTH`` deep (so parsing stops early, whatever the input), no aliases
  (``*name``: the "billion laughs" blow-up needs them and a job spec never does), no tags beyond the
  plain ones, no duplicate keys (YAML keeps the last one silently; we refuse to guess).
- Every error is a ``SpecError`` whose ``str()`` is one line ``FILE:LINE: FIELD.PATH: message``.
  The line is the value's for a bad value, the key's for an unknown or duplicate key, the section's
  for a key missing from a section; a key missing from the top level has the file alone.
- ``JobSpec.to_dict()`` is the canonical form: every key present, defaults filled in, numbers
  declared as numbers always ``float``, integers always ``int``, lists as lists. The job terms
  (protocol/messages.py) are built from it and hashed into the job ID, so two specs that mean the
  same job give the same dict: ``alpha: 16`` and ``alpha: 16.0`` both give ``16.0``, a hash in
  capitals is lowered. Upper bounds are the terms' own, so a valid spec can always be announced.
- Rules tying keys together live in ``_check_across_fields`` and nowhere else.

This module knows nothing of files (agent/specfile.py reads them: ``load_spec``) nor of the network.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import yaml

from protocol.errors import SpecError
from protocol.schedule import INNER_SCHEDULES  # the rate within a round (IPIP-0006 §2.5)
# what the terms allow, read from them (one list each): the training methods, the aggregations full
# fine-tuning may use, the DPO objective and its beta's bound
from protocol.messages import FULL_AGGREGATIONS, MAX_DPO_BETA, MAX_FIRST_ROUNDS, OBJECTIVES, TRAINING_METHODS

MAX_SPEC_BYTES = 1 << 20  # a job spec is a page of settings; 1 MiB is generous
MAX_DEPTH = 16  # the spec nests 3 deep; the cap keeps the recursive composer off the stack limit
MAX_NODES = 2000  # a full spec has ~150; pure-Python YAML takes ~20 s for 1 MiB of tiny nodes
# Upper bounds match the job terms' (protocol/messages.py), so every valid spec can be announced;
# tests/protocol/test_jobspec.py checks a spec at every maximum against them.
MAX_INT = 2**53  # count fields of the terms; also exact in a float and in JSON
MAX_NAME = 256  # characters of name, base_model and any text that goes into the terms
MAX_PATH = 4096  # characters of input.dataset (a local path is replaced by shard CIDs on announcing)
MAX_DESCRIPTION = 4096  # characters of description (the terms' MAX_TEXT)
MAX_MODULES = 64  # target_modules: items, and characters per item
MAX_SHARDS = 1024

SPEC_FILE_NAME = "infernet.train.yml"  # what `infernet train init` writes
ROBUST_AGGREGATIONS = ("median", "trimmed_mean")
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov", "adam")
OUTER_METHODS = ("fedavg", "exact")  # an outer step needs a mean in the adapters' own coordinates
LR_SCHEDULES = ("constant", "cosine")
OPTIMIZER_STATES = ("fresh", "carried")  # a round's AdamW: afresh, or the previous round's averaged state
REPORT_CODECS = ("none", "int8", "int4", "int4-log", "int4-fresh")  # a report's end state: whole tensors, or int8-coded deltas (IPIP-0006 §2.8)
# The outer optimizer a spec gets when it names none; chosen from scripts/bench_quality.py (IPIP-0006 §2.4).
OUTER_DEFAULT = {"optimizer": "none", "lr": 1.0, "momentum": 0.0}
MIN_SHARDS_FOR_ROBUST = 3  # a median or trimmed mean of two updates is just their mean
TYPES = OBJECTIVES  # `type` is the terms' TrainingTerms.objective
FORMATS = ("chatml", "preference")  # input.format: what a record is
FORMAT_OF_TYPE = {"sft": "chatml", "dpo": "preference"}


# --- rules: what one value must be -------------------------------------------------------------


class _Mismatch(Exception):
    """A value broke its rule; the caller turns this into a located SpecError."""

    def __init__(self, message: str) -> None:
        self.message = message


def _describe(value: Any) -> str:
    """How an offending value is quoted back in an error message."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"a {value.bit_length()}-bit integer"  # printing it could take a page, or fail
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if not value:
            return "an empty string"
        shown = repr(value if len(value) <= 60 else value[:57] + "...")
        # "true" or "8" in quotes is text to YAML; say so, it is the usual mistake
        return f"the string {shown}" if _plain_scalar_tag(value) != _STR else shown
    if isinstance(value, dict):
        return "a mapping" if value else "an empty mapping"
    if isinstance(value, (list, tuple)):
        return "a list" if value else "an empty list"
    return type(value).__name__


class _Rule:
    expected: str  # completes "expected ..."

    def check(self, value: Any) -> Any:
        """Return the value in canonical type, or raise _Mismatch."""
        raise NotImplementedError

    def mismatch(self, value: Any) -> _Mismatch:
        return _Mismatch(f"expected {self.expected}, got {_describe(value)}")


class _Integer(_Rule):
    def __init__(self, minimum: int, maximum: int = MAX_INT) -> None:
        self.minimum, self.maximum = minimum, maximum
        self.expected = (f"an integer >= {minimum}" if maximum == MAX_INT
                         else f"an integer from {minimum} to {maximum}")

    def check(self, value: Any) -> int:
        if type(value) is not int or value < self.minimum:
            raise self.mismatch(value)
        if value > self.maximum:
            raise _Mismatch(f"expected an integer from {self.minimum} to {self.maximum}, got {_describe(value)}")
        return value


class _Number(_Rule):
    """A finite real number within bounds; ``open_low``/``open_high`` exclude the bound itself."""

    def __init__(self, low: float, high: float = math.inf, open_low: bool = False,
                 open_high: bool = False) -> None:
        self.low, self.high, self.open_low, self.open_high = low, high, open_low, open_high
        if high == math.inf:
            self.expected = "a positive number" if open_low and low == 0 else f"a number >= {low:g}"
        else:
            self.expected = (f"a number in {'(' if open_low else '['}{low:g}, "
                             f"{high:g}{')' if open_high else ']'}")

    def check(self, value: Any) -> float:
        if type(value) not in (int, float):
            raise self.mismatch(value)
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            raise self.mismatch(value) from None
        if not math.isfinite(number):
            raise self.mismatch(value)
        if number < self.low or (self.open_low and number == self.low):
            raise self.mismatch(value)
        if number > self.high or (self.open_high and number == self.high):
            raise self.mismatch(value)
        return number


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class _Text(_Rule):
    expected = "a non-empty string"

    def __init__(self, max_len: int = MAX_NAME) -> None:
        self.max_len = max_len

    def check(self, value: Any) -> str:
        if type(value) is not str or not value.strip():
            raise self.mismatch(value)
        if len(value) > self.max_len:
            raise _Mismatch(f"expected at most {self.max_len} characters, got {len(value)}")
        if _CONTROL.search(value):
            raise _Mismatch(f"expected a single line of text, got {value[:60]!r}")
        return value


class _OptionalText(_Text):
    """Text, or "" for unset (a key whose absence another key makes up for, or means the default)."""

    def check(self, value: Any) -> str:
        return value if value == "" else super().check(value)


class _Choice(_Rule):
    def __init__(self, *options: str) -> None:
        self.options = options
        self.expected = "one of " + ", ".join(repr(o) for o in options)

    def check(self, value: Any) -> str:
        if type(value) is not str or value not in self.options:
            close = (difflib.get_close_matches(value.lower(), self.options, n=1, cutoff=0.6)
                     if isinstance(value, str) else [])
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _Mismatch(f"expected {self.expected}, got {_describe(value)}{hint}")
        return value


class _Flag(_Rule):
    expected = "true or false"

    def check(self, value: Any) -> bool:
        if type(value) is not bool:
            raise self.mismatch(value)
        return value


class _Sha256(_Rule):
    expected = "64 hex digits (a sha256) or nothing"

    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        if type(value) is not str or not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise self.mismatch(value)
        return value.lower()


class _Description(_Rule):
    expected = f"text of at most {MAX_DESCRIPTION} characters"

    def check(self, value: Any) -> str:
        if type(value) is not str:
            raise self.mismatch(value)
        if len(value) > MAX_DESCRIPTION:
            raise _Mismatch(f"expected at most {MAX_DESCRIPTION} characters, got {len(value)}")
        if re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", value):
            raise _Mismatch("expected text (lines and tabs allowed, no other control characters)")
        return value


class _TextList(_Rule):
    expected = "a non-empty list of non-empty strings"

    def check(self, value: Any) -> tuple[str, ...]:
        if type(value) not in (list, tuple) or not value:
            raise self.mismatch(value)
        if len(value) > MAX_MODULES:
            raise _Mismatch(f"expected at most {MAX_MODULES} items, got {len(value)}")
        return tuple(value)  # items are checked one by one by the reader, to name their index


class _IntegerList(_Rule):
    """A list of integers >= 1 (possibly empty); items are checked one by one by the reader, to name their index."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.expected = "a list of integers >= 1"

    def check(self, value: Any) -> tuple[int, ...]:
        if type(value) not in (list, tuple):
            raise self.mismatch(value)
        if len(value) > self.max_items:
            raise _Mismatch(f"expected at most {self.max_items} items, got {len(value)}")
        return tuple(value)


# --- the spec: one dataclass per section, one field per key ------------------------------------


def _key(default: Any, rule: _Rule) -> Any:
    """A key of the spec: its default (MISSING = required) and the rule its value obeys."""
    return field(default=default, metadata={"rule": rule})


def _section(cls: type) -> Any:
    """A section of the spec; required if any of its keys is (only ``input``, for its dataset)."""
    if any(f.default is MISSING for f in fields(cls)):
        return field(metadata={"section": cls})
    return field(default_factory=cls, metadata={"section": cls})


# Meanings are in the TEMPLATE below and in ipips/0007; upper bounds are those of the job terms.

@dataclass(frozen=True, kw_only=True)
class InputSpec:
    dataset: str = _key("", _OptionalText(MAX_PATH))  # local path, or a CID (bare or ipfs://): dataset_cid(); or hf
    hf: str = _key("", _OptionalText(4 * MAX_NAME))  # a Hugging Face dataset (Hub name or a folder datasets reads)
    split: str = _key("train", _Text(MAX_NAME))
    config: str = _key("", _OptionalText(MAX_NAME))
    revision: str = _key("", _OptionalText(MAX_NAME))
    # chatml for sft, preference for dpo: the parser derives the default from type (IPIP-0007)
    format: str = _key("chatml", _Choice(*FORMATS))
    validation_split: float = _key(0.0, _Number(0, 0.5, open_high=True))


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    epochs: int = _key(1, _Integer(1, 10_000))
    learning_rate: float = _key(2e-4, _Number(0, open_low=True))
    batch_size: int = _key(4, _Integer(1, 65_536))
    gradient_accumulation_steps: int = _key(1, _Integer(1, 65_536))
    max_seq_len: int = _key(512, _Integer(8, 1 << 20))
    max_steps: int = _key(0, _Integer(0))  # 0 = no limit
    schedule: str = _key("constant", _Choice(*LR_SCHEDULES))
    warmup_rounds: int = _key(0, _Integer(0, 1000))
    optimizer_state: str = _key("carried", _Choice(*OPTIMIZER_STATES))
    report_codec: str = _key("none", _Choice(*REPORT_CODECS))
    inner_schedule: str = _key("constant", _Choice(*INNER_SCHEDULES))
    packing: bool = _key(False, _Flag())
    aggregate_codec: str = _key("none", _Choice(*REPORT_CODECS))
    first_round_steps: tuple[int, ...] = _key((), _IntegerList(MAX_FIRST_ROUNDS))


@dataclass(frozen=True, kw_only=True)
class OuterSpec:
    optimizer: str = _key(OUTER_DEFAULT["optimizer"], _Choice(*OUTER_OPTIMIZERS))
    lr: float = _key(OUTER_DEFAULT["lr"], _Number(0, 100, open_low=True, open_high=True))
    momentum: float = _key(OUTER_DEFAULT["momentum"], _Number(0, 1, open_high=True))
    beta1: float = _key(0.9, _Number(0, 1, open_high=True))
    beta2: float = _key(0.99, _Number(0, 1, open_high=True))


@dataclass(frozen=True, kw_only=True)
class StopSpec:
    validation_loss_below: float = _key(0.0, _Number(0))
    patience_rounds: int = _key(0, _Integer(0, 1000))


@dataclass(frozen=True, kw_only=True)
class DpoSpec:
    beta: float = _key(0.1, _Number(0, MAX_DPO_BETA, open_low=True))


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    rank: int = _key(8, _Integer(1, 4096))
    alpha: float = _key(16.0, _Number(0, open_low=True))
    dropout: float = _key(0.0, _Number(0, 1, open_high=True))
    target_modules: tuple[str, ...] = _key(("q_proj", "v_proj"), _TextList())
    # True is the default for the default aggregation ("exact"); the parser derives it from the
    # aggregation actually chosen
    freeze_a: bool = _key(True, _Flag())


@dataclass(frozen=True, kw_only=True)
class ResourcesSpec:
    min_vram_gb: float = _key(0.0, _Number(0))
    max_runtime_hours: float = _key(24.0, _Number(0, 8760, open_low=True))  # at most a year


@dataclass(frozen=True, kw_only=True)
class ProofSpec:
    checkpoint_every: int = _key(20, _Integer(1))
    verify_segments: int = _key(2, _Integer(0, 1024))
    tolerance: float = _key(0.0001, _Number(0))


@dataclass(frozen=True, kw_only=True)
class BudgetSpec:
    price_per_hour: float = _key(0.0, _Number(0))
    total: float = _key(0.0, _Number(0))


AGGREGATIONS = ("fedavg", "exact", "svd", "median", "trimmed_mean")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    name: str = _key(MISSING, _Text())
    description: str = _key("", _Description())  # what the job is for; informative
    base_model: str = _key(MISSING, _Text())
    base_model_sha256: str | None = _key(None, _Sha256())
    type: str = _key("sft", _Choice(*TYPES))  # sft: supervised on ChatML; dpo: preferences (IPIP-0005 §6.2)
    method: str = _key("lora", _Choice(*TRAINING_METHODS))  # full: every weight (small models: FULL_MAX_PARAMETERS)
    runtime: str = _key("peft", _Choice("peft", "unsloth"))
    seed: int = _key(0, _Integer(0))
    input: InputSpec = _section(InputSpec)
    training: TrainingSpec = _section(TrainingSpec)
    dpo: DpoSpec = _section(DpoSpec)
    lora: LoraSpec = _section(LoraSpec)
    resources: ResourcesSpec = _section(ResourcesSpec)
    shards: int = _key(1, _Integer(1, MAX_SHARDS))
    rounds: int = _key(1, _Integer(1, 1000))
    aggregation: str = _key("exact", _Choice(*AGGREGATIONS))
    outer: OuterSpec = _section(OuterSpec)
    stop_when: StopSpec = _section(StopSpec)
    min_accepted_fraction: float = _key(1.0, _Number(0, 1, open_low=True))
    max_retries: int = _key(2, _Integer(0, 100))
    proof: ProofSpec = _section(ProofSpec)
    lease_seconds: int = _key(3600, _Integer(10))
    budget: BudgetSpec = _section(BudgetSpec)
    private: bool = _key(False, _Flag())  # seal the final aggregate to the submitter (ipips/0010)

    @property
    def min_accepted_shards(self) -> int:
        """Accepted shards a round needs to publish: ceil(fraction x shards), never below 1.

        Rounded to 9 places first so that 0.1 x 10 is 1, not 2 (binary floats are slightly off).
        """
        return max(1, math.ceil(round(self.min_accepted_fraction * self.shards, 9)))

    def to_dict(self) -> dict[str, Any]:
        """The canonical form: plain dicts, lists, str, int, float, bool, None; every key present."""
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Validate a plain dict (missing keys take defaults) by the same rules as the YAML file."""
        return _read_job(data, Where("", {}, {}))


def _to_plain(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(spec):
        value = getattr(spec, f.name)
        if "section" in f.metadata:
            out[f.name] = _to_plain(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


# --- the template: what `infernet train init` writes ---------------------------------------------

TEMPLATE = """\
# infernet.train.yml: a LoRA fine-tuning job for the infernet network.
# Only name, base_model and input.dataset are required; every other key is shown at its default.
# Full reference: ipips/0007-job-spec.md. Quoted values are always text: write 8, not "8".

name: my-adapter                  # a label for people; the job ID is a hash of the whole spec
description: ""                   # what the job is for, for people (at most 4096 characters)
base_model: ./base-model          # local path, or a hub name such as org/model
# base_model_sha256: <64 hex>     # sha256 of the base model's weights; workers refuse a mismatch.
                                  # Unset by default; the submitter tooling may fill it in.
type: sft                         # sft: learn the assistant turns of ChatML conversations
                                  # dpo: learn to prefer chosen over rejected completions (input.format
                                  #   preference; the reference model is the base, adapter disabled)
method: lora                      # lora | qlora | full (qlora: 4-bit base model, needs a GPU and
                                  #   bitsandbytes; full: every weight trains, base models up to 80M
                                  #   parameters; aggregation fedavg (its default), median or trimmed_mean)
runtime: peft                     # peft (CPU or GPU) | unsloth (GPU only)
seed: 0                           # job seed, same for every worker: LoRA A init, data shuffles

input:
  dataset: ./train.jsonl          # local path, or the dataset's IPFS CID (bafy... or ipfs://bafy...):
                                  #   the submitter fetches it, checks it against the CID, then shards it
  # hf: org/name                  # instead of dataset: a Hugging Face dataset (Hub name, from its cache
  # split: train                  #   or the Hub with HF_TOKEN, or a local folder datasets reads), its split,
  # config: ""                    #   config and revision; the submitter converts it to ChatML once and
  # revision: ""                  #   shards that file (messages, conversations, prompt/completion, alpaca)
  # format: chatml                # follows type. chatml (sft): JSON lines of {"messages": [{"role": ...,
                                  #   "content": ...}]}; preference (dpo): {"prompt", "chosen", "rejected"}
                                  #   as text or message lists, or chosen/rejected conversations
  validation_split: 0.0           # fraction held out before sharding to validate aggregates, in [0, 0.5)

training:                         # what each worker does with its shard in each round
  epochs: 1                       # passes over the shard per round, >= 1
  learning_rate: 0.0002           # > 0
  batch_size: 4                   # examples per micro-batch, >= 1
  gradient_accumulation_steps: 1  # micro-batches per optimizer step, >= 1
  max_seq_len: 512                # tokens per example, >= 8; longer examples are truncated
  packing: false                  # true: examples are concatenated into sequences of max_seq_len
                                  #   tokens (a GPU's work: few padded tokens); a step's samples are those
  max_steps: 0                    # optimizer steps per shard and round; 0 = no limit (epochs decide)
  schedule: constant              # constant | cosine: the learning rate across rounds (cosine decays
                                  #   it to 0.1x by the last round); constant within a round
  warmup_rounds: 0                # first rounds ramp the rate up linearly, < rounds
  inner_schedule: constant        # constant | triangle: the rate within each round (triangle: warm up
                                  #   over its first 10 % of steps, then decay to 0.1x at its last)
  optimizer_state: carried        # carried | fresh: each round's AdamW starts from the accepted
                                  #   workers' averaged state (carried), or afresh as in round 1
  report_codec: none              # none | int8 | int4 | int4-log | int4-fresh: a worker's report sends
                                  #   its round's end state whole, or as coded deltas and moments
                                  #   (int8 ~5x, int4* ~9x fewer bytes)
  aggregate_codec: none           # none | the same codecs: each round's aggregate (rounds 2 to the
                                  #   last but one) travels to the next round's workers as an update
                                  #   from the round's start, ~9x fewer bytes with int4-fresh; the
                                  #   aggregate is then that update's decoded state
  first_round_steps: []          # steps of the first rounds, before max_steps a round (needs max_steps):
                                  #   e.g. [25, 25, 50] before 100-step rounds; short rounds first keep
                                  #   long rounds' quality (IPIP-0006 §2.5)

dpo:                              # type dpo only
  beta: 0.1                       # in (0, 100]: how far the adapter may move from the base model's
                                  #   preferences (larger: closer to the base)

lora:
  rank: 8                         # r, >= 1
  alpha: 16                       # scaling alpha > 0; the update is scaled by alpha / rank
  dropout: 0.0                    # in [0, 1); 0 keeps a verifier's replay exact
  target_modules: [q_proj, v_proj]  # names of the modules that get adapters
  # freeze_a: true                # keep A at its init from the seed; default true when
                                  # aggregation is exact (then it must be true), else false

resources:
  min_vram_gb: 0                  # GPU memory a worker needs; 0 = CPU workers welcome
  max_runtime_hours: 24           # wall-clock limit of the whole job, > 0

shards: 1                         # parts the dataset is split into, one worker each, >= 1
rounds: 1                         # train-then-aggregate rounds, >= 1
aggregation: exact                # exact | svd | fedavg | median | trimmed_mean
                                  #   exact: A frozen, B averaged by samples (exact for LoRA)
                                  #   svd: average B.A by samples, re-factor by truncated SVD
                                  #   fedavg: average A and B apart (a baseline: not exact)
                                  #   median, trimmed_mean: robust to bad shards; need >= 3 accepted
outer:                            # the outer optimizer: how each round's mean update is applied
  optimizer: none                 # none | sgd | nesterov | adam; none = take the mean as is (FedAvg).
                                  #   Needs aggregation exact or fedavg
  lr: 1.0                         # outer learning rate in (0, 100); sgd with lr 1 = none
  momentum: 0.0                   # sgd / nesterov momentum in [0, 1)
  beta1: 0.9                      # adam
  beta2: 0.99                     # adam
stop_when:                        # end the job before its last round (needs input.validation_split)
  validation_loss_below: 0        # once a round's validation loss is below this; 0 = off
  patience_rounds: 0              # once the best loss has not improved for this many rounds; 0 = off
min_accepted_fraction: 1.0        # fraction of a round's shards accepted before it publishes, in (0, 1]
max_retries: 2                    # extra attempts per shard after a failed, expired or rejected lease

proof:                            # proof of training
  checkpoint_every: 20            # optimizer steps between committed checkpoints, >= 1
  verify_segments: 2              # segments a verifier replays per shard; 0 = no replay
  tolerance: 0.0001               # largest relative L2 distance a replay may differ by when the
                                  # environments differ (fp32); identical environments must match exactly

lease_seconds: 3600               # how long a worker holds a shard before it may be reassigned, >= 10

budget:
  price_per_hour: 0               # offered per worker-hour, >= 0; 0 = volunteer job
  total: 0                        # most the submitter pays for the whole job, >= 0

private: false                    # true: the final aggregate is sealed to the submitter's key; only
                                  #   the submitter can open it (ipips/0010-sealed-results.md)
"""


# --- reading a validated spec out of plain values ----------------------------------------------

_Path = tuple[str | int, ...]


_PLAIN_NAME = re.compile(r"[\w<>-]{1,64}")


def _dotted(path: _Path) -> str:
    """``lora.target_modules[2]``; a key that is not a plain name is quoted: ``training['a b']``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _PLAIN_NAME.fullmatch(part):
            out += f"[{part[:40]!r}]"
        else:
            out += f".{part}" if out else part
    return out


@dataclass
class Where:
    """Turns a field path into a SpecError located at the right line of the source."""

    source: str
    value_lines: dict[_Path, int]
    key_lines: dict[_Path, int]

    def at(self, line: int | None) -> str:
        if not self.source:
            return ""
        return f"{self.source}:{line}" if line else self.source

    def bad_value(self, path: _Path, message: str) -> SpecError:
        return SpecError(_dotted(path), message, self.at(self.value_lines.get(path)))

    def bad_key(self, path: _Path, message: str) -> SpecError:
        return SpecError(_dotted(path), message, self.at(self.key_lines.get(path)))

    def missing(self, path: _Path) -> SpecError:
        # the line of the section that lacks the key; the top level has no line to point at
        return SpecError(_dotted(path), "required key is missing", self.at(self.key_lines.get(path[:-1])))


def _all_key_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """key name -> dotted path, for every key and section of the spec (names are unique)."""
    out: dict[str, str] = {}
    for f in fields(cls):
        out[f.name] = prefix + f.name
        if "section" in f.metadata:
            out.update(_all_key_paths(f.metadata["section"], f"{prefix}{f.name}."))
    return out


def _unknown_key_message(key: str, cls: type) -> str:
    """Suggest the key meant: the same name in another section, else the closest name here or anywhere."""
    everywhere = _all_key_paths(JobSpec)
    if key in everywhere:
        return f"unknown key here (did you mean '{everywhere[key]}'?)"
    here = [f.name for f in fields(cls)]
    candidates = here + [path for path in everywhere.values() if path not in here]
    best = max(candidates, key=lambda name: difflib.SequenceMatcher(None, key, name).ratio())
    if difflib.SequenceMatcher(None, key, best).ratio() >= 0.6:
        return f"unknown key{'' if best in here else ' here'} (did you mean '{best}'?)"
    return "unknown key (expected one of: " + ", ".join(sorted(here)) + ")"


def _read_section(cls: type, value: Any, path: _Path, where: Where,
                  defaults: dict[str, Any] | None = None) -> Any:
    if value is None:
        value = {}  # a section whose keys are all commented out: all defaults
    if not isinstance(value, dict):
        if not path:
            raise where.bad_value(path, "expected a mapping of job settings at the top level, "
                                        f"got {_describe(value)}")
        raise where.bad_value(path, f"expected a mapping, got {_describe(value)}")
    names = {f.name for f in fields(cls)}
    for key in value:
        if not isinstance(key, str):
            raise where.bad_value(path, f"keys must be names, got {_describe(key)}")
        if key not in names:
            raise where.bad_key(path + (key,), _unknown_key_message(key, cls))
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        sub = path + (f.name,)
        if "section" in f.metadata:
            kwargs[f.name] = _read_section(f.metadata["section"], value.get(f.name), sub, where,
                                           (defaults or {}).get(f.name))
        elif f.name in value:
            kwargs[f.name] = _read_value(f.metadata["rule"], value[f.name], sub, where)
        elif defaults and f.name in defaults:
            kwargs[f.name] = defaults[f.name]
        elif f.default is MISSING:
            raise where.missing(sub)
    return cls(**kwargs)


def _read_value(rule: _Rule, value: Any, path: _Path, where: Where) -> Any:
    try:
        checked = rule.check(value)
        if isinstance(rule, _IntegerList):
            for index, item in enumerate(checked):
                _read_value(_Integer(1), item, path + (index,), where)
        if isinstance(rule, _TextList):
            seen: set[str] = set()
            for index, item in enumerate(checked):
                _read_value(_Text(MAX_MODULES), item, path + (index,), where)
                if item in seen:
                    raise where.bad_value(path + (index,), f"duplicate {item!r}")
                seen.add(item)
        return checked
    except _Mismatch as mismatch:
        raise where.bad_value(path, mismatch.message) from None


def _read_job(data: Any, where: Where) -> JobSpec:
    # aggregation's default follows the method (fedavg for full), freeze_a's the aggregation, and input.format's
    # the type: all read before the sections are
    method, kind = "lora", "sft"
    if isinstance(data, dict) and "method" in data:
        method = _read_value(_Choice(*TRAINING_METHODS), data["method"], ("method",), where)
    aggregation = "fedavg" if method == "full" else "exact"
    if isinstance(data, dict) and "aggregation" in data:
        aggregation = _read_value(_Choice(*AGGREGATIONS), data["aggregation"], ("aggregation",), where)
    if isinstance(data, dict) and "type" in data:
        kind = _read_value(_Choice(*TYPES), data["type"], ("type",), where)
    spec = _read_section(JobSpec, data, (), where,
                         defaults={"aggregation": aggregation, "lora": {"freeze_a": aggregation == "exact"},
                                   "input": {"format": FORMAT_OF_TYPE[kind]}})
    _check_across_fields(spec, where)
    return spec


def hf_source(input_spec: InputSpec) -> str:
    """What the terms record of a Hugging Face input (``JobTerms.dataset_source``); "" for a file or a CID."""
    if not input_spec.hf:
        return ""
    return describe_hf(input_spec.hf, input_spec.config, input_spec.split, input_spec.revision)


def describe_hf(name: str, config: str, split: str, revision: str) -> str:
    """A Hugging Face dataset's split as the terms (and errors about it) name it:
    ``hf:NAME[@REVISION][ config=CONFIG] split=SPLIT``."""
    return "hf:" + name + (f"@{revision}" if revision else "") + (f" config={config}" if config else "") + f" split={split}"


def dataset_cid(dataset: str) -> str | None:
    """The CID that ``input.dataset`` names, or None for a local path (IPIP-0007 "input.dataset").

    ``ipfs://CID`` (optionally ``ipfs://CID/``) is always a CID; a bare value that parses as a CID
    (``bafy...``, ``Qm...``) is one too (write ``./bafy...`` for a file of that name). Raises
    CIDError for an ``ipfs://`` value that does not hold a CID."""
    from protocol.cid import parse_cid
    from protocol.errors import CIDError

    text = dataset.strip()
    if text.startswith("ipfs://"):
        return str(parse_cid(text[len("ipfs://"):].rstrip("/")))
    if "/" in text or "." in text:
        return None
    try:
        return str(parse_cid(text))
    except CIDError:
        return None


def _check_across_fields(spec: JobSpec, where: Where) -> None:
    """Rules that tie two keys together (ipips/0007, "Rules across keys")."""
    if bool(spec.input.dataset) == bool(spec.input.hf):
        if spec.input.dataset:
            raise where.bad_value(("input", "hf"), "give input.dataset or input.hf, not both")
        missing = where.missing(("input", "dataset"))  # at the line of the input section, when there is one
        raise SpecError(missing.path, f"{missing.message} (a file or a CID; or input.hf, a Hugging Face dataset)",
                        missing.location)
    if spec.input.dataset.strip().startswith("ipfs://"):
        from protocol.errors import CIDError

        try:
            dataset_cid(spec.input.dataset)
        except CIDError as exc:
            raise where.bad_value(("input", "dataset"), f"not an IPFS CID: {exc}") from None
    if spec.input.format != FORMAT_OF_TYPE[spec.type]:
        raise where.bad_value(("input", "format"), f"a {spec.type} job reads {FORMAT_OF_TYPE[spec.type]} records, "
                              f"not {spec.input.format} (leave format out: it follows type)")
    if spec.method == "full" and spec.aggregation not in FULL_AGGREGATIONS:
        raise where.bad_value(("aggregation",), f"full fine-tuning averages weights: use {', '.join(FULL_AGGREGATIONS)}, "
                              f"not {spec.aggregation!r} (a rule for LoRA factors)")
    if spec.method == "full" and spec.type == "dpo":
        raise where.bad_value(("type",), "dpo needs method lora or qlora: its reference model is the base model "
                              "with the adapter disabled, and full fine-tuning has no adapter to disable")
    if spec.method == "full" and spec.training.aggregate_codec != "none":
        raise where.bad_value(("training", "aggregate_codec"), "full fine-tuning's aggregate travels whole: an "
                              "update codes an adapter and its AdamW state (write aggregate_codec: none)")
    if spec.method == "full" and spec.runtime != "peft":
        raise where.bad_value(("runtime",), f"full fine-tuning runs on the peft runtime (torch + transformers), "
                              f"not {spec.runtime}")
    if spec.type != "sft" and spec.training.packing:
        raise where.bad_value(("training", "packing"), f"packing concatenates sft examples; a {spec.type} job "
                              "trains on whole pairs (write packing: false)")
    if spec.outer.optimizer != "none" and spec.aggregation not in OUTER_METHODS:
        raise where.bad_value(("outer", "optimizer"), (
            f"an outer optimizer needs aggregation {' or '.join(OUTER_METHODS)}, not {spec.aggregation!r} "
            f"(write optimizer: none, or change the aggregation)"))
    stop = spec.stop_when
    if (stop.validation_loss_below > 0 or stop.patience_rounds > 0) and spec.input.validation_split == 0:
        key = "validation_loss_below" if stop.validation_loss_below > 0 else "patience_rounds"
        raise where.bad_value(("stop_when", key), "stopping early needs a validation split: set "
                              "input.validation_split (the coordinator scores each round on it)")
    if spec.training.warmup_rounds >= spec.rounds and spec.training.warmup_rounds:
        raise where.bad_value(("training", "warmup_rounds"),
                              f"must be less than rounds ({spec.rounds}): no round would train at the full rate")
    first = spec.training.first_round_steps
    if first and spec.training.max_steps == 0:
        raise where.bad_value(("training", "first_round_steps"), "needs max_steps, the steps of the rounds after "
                              "them (write max_steps: N)")
    if first and len(first) >= spec.rounds:
        raise where.bad_value(("training", "first_round_steps"), f"names {len(first)} rounds, but the job has "
                              f"{spec.rounds}: at most {spec.rounds - 1} (the rounds after them train max_steps)")
    if spec.aggregation == "exact" and not spec.lora.freeze_a:
        raise where.bad_value(("lora", "freeze_a"), "must be true when aggregation is 'exact' "
                              "(averaging B alone is exact only if every worker keeps the same A)")
    if spec.aggregation in ROBUST_AGGREGATIONS and spec.min_accepted_shards < MIN_SHARDS_FOR_ROBUST:
        raise where.bad_value(("aggregation",), (
            f"{spec.aggregation!r} needs at least {MIN_SHARDS_FOR_ROBUST} accepted shards per round, "
            f"but shards: {spec.shards} with min_accepted_fraction: {spec.min_accepted_fraction:g} "
            f"lets a round publish with {spec.min_accepted_shards}"))


# --- reading YAML: compose nodes, type plain scalars by YAML 1.2 core --------------------------

_YAML = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_YAML + t for t in ("str", "int", "float", "bool", "null"))
_MAP, _SEQ = _YAML + "map", _YAML + "seq"

_NULL_TEXT = re.compile(r"(?:~|null|Null|NULL|)\Z")
_BOOL_TEXT = re.compile(r"(?:true|True|TRUE|false|False|FALSE)\Z")
_INT_TEXT = re.compile(r"[-+]?[0-9]+\Z")
_FLOAT_TEXT = re.compile(
    r"(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z")
_MAX_INT_DIGITS = 30  # beyond any allowed value, and far below Python's int-parsing limit


def _plain_scalar_tag(text: str) -> str:
    """The tag YAML 1.2's core schema gives an unquoted scalar."""
    for tag, pattern in ((_NULL, _NULL_TEXT), (_BOOL, _BOOL_TEXT), (_INT, _INT_TEXT),
                         (_FLOAT, _FLOAT_TEXT)):
        if pattern.match(text):
            return tag
    return _STR


class _RefusedYAML(Exception):
    """Valid YAML that a job spec does not allow (an alias, deep nesting)."""

    def __init__(self, message: str, mark: yaml.Mark) -> None:
        self.message, self.mark = message, mark


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader, composing only, with YAML 1.2 core scalars, no merge keys, no aliases, bounded size."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.nodes = 0

    def resolve(self, kind: type, value: str | None, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0]:
            return _plain_scalar_tag(value or "")
        return super().resolve(kind, value, implicit)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            raise _RefusedYAML("YAML aliases (*name) are not allowed in a job spec",
                               self.peek_event().start_mark)
        if self.depth >= MAX_DEPTH:
            raise _RefusedYAML(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _RefusedYAML(f"more than {MAX_NODES} YAML values", self.peek_event().start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _scalar_value(node: yaml.ScalarNode) -> Any:
    """The value of a scalar by its tag, resolved or explicit (``!!int "8"``); _Mismatch if it does not fit."""
    text = node.value
    if node.tag == _STR:
        return text
    if node.tag == _NULL and _NULL_TEXT.match(text):
        return None
    if node.tag == _BOOL and _BOOL_TEXT.match(text):
        return text.lower() == "true"
    if node.tag == _INT and _INT_TEXT.match(text):
        if len(text.lstrip("+-")) > _MAX_INT_DIGITS:
            raise _Mismatch(f"integer too large: {text[:30]}...")
        return int(text)
    if node.tag == _FLOAT and _FLOAT_TEXT.match(text):
        lowered = text.lower()
        return float(lowered.replace(".", "") if lowered.endswith(("inf", "nan")) else lowered)
    if node.tag in (_NULL, _BOOL, _INT, _FLOAT):
        raise _Mismatch(f"{text[:60]!r} is not a valid {_short_tag(node.tag)}")
    raise _Mismatch(f"unsupported YAML tag {_short_tag(node.tag)}")


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML):] if tag.startswith(_YAML) else tag


def _node_value(node: yaml.Node, path: _Path, where: Where) -> Any:
    """Plain Python value of a node, recording the line of every value and key on the way."""
    where.value_lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.ScalarNode):
        try:
            return _scalar_value(node)
        except _Mismatch as mismatch:
            raise where.bad_value(path, mismatch.message) from None
    if isinstance(node, yaml.SequenceNode) and node.tag == _SEQ:
        return [_node_value(item, path + (i,), where) for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode) and node.tag == _MAP:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                raise SpecError(_dotted(path), f"keys must be names, got {kind}",
                                where.at(key_node.start_mark.line + 1))
            key = key_node.value
            key_path = path + (key,)
            if key in out:
                first = where.key_lines[key_path]
                where.key_lines[key_path] = key_node.start_mark.line + 1
                raise where.bad_key(key_path, f"duplicate key (first given at line {first})")
            where.key_lines[key_path] = key_node.start_mark.line + 1
            out[key] = _node_value(value_node, key_path, where)
        return out
    raise where.bad_value(path, f"unsupported YAML tag {_short_tag(node.tag)}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def parse_spec(text: str, source: str = "<string>") -> JobSpec:
    """Parse and validate the text of a job spec; ``source`` names it in error messages."""
    data, where = read_yaml(text, source)
    return _read_job(data, where)


def read_yaml(text: str, source: str = "<string>", what: str = "job settings") -> tuple[Any, Where]:
    """The plain value of a YAML document under this file's rules (YAML 1.2 scalars, no aliases,
    no tags, no duplicate keys, bounded), and where each key and value is: ``where.bad_value(path,
    message)`` makes a SpecError located at its line. Used for job specs and harness scenarios."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError("", f"larger than {MAX_SPEC_BYTES} bytes", source)
    where = Where(source, {}, {})
    loader = None
    try:
        loader = _SpecLoader(text)  # the reader rejects unprintable characters right here
        root = loader.get_single_node()
    except _RefusedYAML as refused:
        raise SpecError("", refused.message, where.at(refused.mark.line + 1)) from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        problem = ", ".join(_one_line(p) for p in (error.context, error.problem) if p)
        raise SpecError("", f"not valid YAML: {problem}", where.at(mark.line + 1 if mark else None)) from None
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        raise SpecError("", f"not valid YAML: character #x{error.character:04x} is not allowed",
                        where.at(line)) from None
    finally:
        if loader is not None:
            loader.dispose()
    if root is None:
        raise SpecError("", f"expected a mapping of {what} at the top level, got an empty document",
                        where.at(1))
    return _node_value(root, (), where), where


def read_job(data: Any, where: Where) -> JobSpec:
    """Validate the plain value of a job spec (from ``read_yaml``); errors located through ``where``."""
    return _read_job(data, where)


def decode_text(data: bytes, source: str = "<bytes>") -> str:
    """The UTF-8 text of a settings file's bytes (at most MAX_SPEC_BYTES; ``source`` names the file in
    errors); every failure is a SpecError. Reading the file is agent/specfile.py's."""
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError("", f"larger than {MAX_SPEC_BYTES} bytes", source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SpecError("", f"not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})",
                        f"{source}:{line}") from None
    return text


def parse_spec_bytes(data: bytes, source: str = "<bytes>") -> JobSpec:
    """Parse and validate a job spec file's bytes; ``source`` names it in error messages."""
    return parse_spec(decode_text(data, source), source)


def to_terms(spec: JobSpec, *, submitter: str, base_model_sha256: bytes, shards: tuple = (),
             validation_cid: str | None = None, created: int = 0, deadline: int | None = None,
             dataset_cid: str | None = None, max_nodes: int = 0, providers: tuple[str, ...] = ()) -> Any:
    """The job's terms (protocol/messages.JobTerms) for ``spec``: every field of the spec that the terms
    carry, mapped here once (issue 23). The submitter announces these (with its shards and hashes);
    workers, verifiers, local runs and estimates all train from terms (agent/train/config.py
    ``TrainConfig.from_terms``), so no copy of the mapping can drift. ``deadline``: by default
    ``created`` plus ``resources.max_runtime_hours``."""
    from protocol import messages as m

    t, lora, proof = spec.training, spec.lora, spec.proof
    stop = spec.stop_when
    return m.JobTerms(
        name=spec.name, submitter=submitter, base_model=spec.base_model, base_model_sha256=base_model_sha256,
        method=spec.method, runtime=spec.runtime, seed=spec.seed, shards=tuple(shards),
        validation_cid=validation_cid,
        training=m.TrainingTerms(t.epochs, t.learning_rate, t.batch_size, t.gradient_accumulation_steps,
                                 t.max_seq_len, t.max_steps, t.schedule, t.warmup_rounds, t.optimizer_state,
                                 t.report_codec, t.inner_schedule, t.packing, spec.type, spec.dpo.beta,
                                 t.aggregate_codec, tuple(t.first_round_steps)),
        lora=m.LoraTerms(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules), lora.freeze_a),
        proof=m.ProofTerms(proof.checkpoint_every, proof.verify_segments, proof.tolerance),
        rounds=spec.rounds, aggregation=spec.aggregation, min_accepted_fraction=spec.min_accepted_fraction,
        max_retries=spec.max_retries, lease_seconds=spec.lease_seconds, min_vram_gb=spec.resources.min_vram_gb,
        deadline=deadline if deadline is not None else created + int(spec.resources.max_runtime_hours * 3600),
        price_per_hour=spec.budget.price_per_hour, budget=spec.budget.total, created=created,
        stop=m.StopTerms(stop.validation_loss_below, stop.patience_rounds)
        if stop.validation_loss_below > 0 or stop.patience_rounds > 0 else None,
        outer=None if spec.outer.optimizer == "none" else m.OuterTerms(
            spec.outer.optimizer, spec.outer.lr, spec.outer.momentum, spec.outer.beta1, spec.outer.beta2),
        description=getattr(spec, "description", ""), private=getattr(spec, "private", False), dataset_cid=dataset_cid,
        dataset_source=hf_source(spec.input),
        max_nodes=max_nodes, providers=tuple(providers),
    )
