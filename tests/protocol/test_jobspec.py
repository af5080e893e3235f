"""Job spec (ipips/0007): vectors, template, file errors, wire limits, and fuzzing that only SpecError escapes."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import jobspec
from protocol import messages as m
from protocol.cid import RAW, CID
from protocol.codec import canonical_encode
from protocol.errors import SpecError
from protocol.identity import Identity
from agent.specfile import load_spec
from protocol.jobspec import TEMPLATE, JobSpec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
VALID = json.loads((ROOT / "ipips/vectors/jobspec-valid.json").read_text())
INVALID = json.loads((ROOT / "ipips/vectors/jobspec-invalid.json").read_text())
SOURCE = VALID["source"]
REQUIRED = {"name": "demo", "base_model": "./tiny-model", "input": {"dataset": "./train.jsonl"}}


def same_typed(a, b) -> bool:
    """Equal, and of the same types all the way down: 16 and 16.0 hash differently in msgpack."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_typed(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_typed(x, y) for x, y in zip(a, b))
    return a == b


def dotted_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += dotted_keys(value, f"{prefix}{key}.")
    return out


# --- vectors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", VALID["cases"], ids=lambda c: c["name"])
def test_valid_vector_gives_its_canonical_form_and_round_trips(case):
    spec = parse_spec(case["yaml"], SOURCE)
    assert same_typed(spec.to_dict(), case["canonical"])
    assert JobSpec.from_dict(case["canonical"]) == spec
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert same_typed(JobSpec.from_dict(spec.to_dict()).to_dict(), case["canonical"])


@pytest.mark.parametrize("case", INVALID["cases"], ids=lambda c: c["name"])
def test_invalid_vector_fails_with_its_exact_line(case):
    with pytest.raises(SpecError) as caught:
        parse_spec(case["yaml"], SOURCE)
    assert str(caught.value) == case["error"]
    assert "\n" not in str(caught.value)


def test_invalid_vectors_cover_every_error_class():
    names = " ".join(c["name"] for c in INVALID["cases"])
    for kind in ("not YAML", "top level", "missing", "wrong type", "out of range", "bad enum",
                 "did-you-mean", "duplicate key", "boolean given as a string", "alias bomb",
                 "too many values", "nesting", "tag", "cross-field"):
        assert kind in names, kind


def test_error_carries_path_and_location_apart():
    with pytest.raises(SpecError) as caught:
        parse_spec("name: a\nbase_model: b\ninput: {dataset: c}\ntraining:\n  epochs: 0\n", "job.yml")
    assert (caught.value.path, caught.value.location) == ("training.epochs", "job.yml:5")
    assert caught.value.message == "expected an integer from 1 to 10000, got 0"


# --- defaults and cross-field rules ------------------------------------------------------------


def test_specs_that_mean_the_same_job_encode_the_same():
    written = parse_spec("name: a\nbase_model: b\ninput: {dataset: c}\nlora: {alpha: 16, freeze_a: true}\n"
                         "base_model_sha256: " + "AB" * 32 + "\nresources: {min_vram_gb: 0}\n")
    implied = JobSpec.from_dict({"name": "a", "base_model": "b", "input": {"dataset": "c"},
                                 "lora": {"alpha": 16.0}, "base_model_sha256": "ab" * 32})
    assert canonical_encode(written.to_dict()) == canonical_encode(implied.to_dict())
    other = JobSpec.from_dict({**implied.to_dict(), "seed": 1})
    assert canonical_encode(other.to_dict()) != canonical_encode(implied.to_dict())


def test_freeze_a_default_follows_the_aggregation():
    for aggregation, expected in (("exact", True), ("fedavg", False), ("svd", False)):
        spec = JobSpec.from_dict({**REQUIRED, "aggregation": aggregation})
        assert spec.lora.freeze_a is expected
    kept = JobSpec.from_dict({**REQUIRED, "aggregation": "fedavg", "lora": {"freeze_a": True}})
    assert kept.lora.freeze_a is True


@pytest.mark.parametrize("fraction, shards, needed", [
    (1.0, 5, 5), (0.1, 10, 1), (0.3, 10, 3), (0.75, 8, 6), (0.5, 3, 2), (0.01, 3, 1), (0.7, 10, 7),
])
def test_min_accepted_shards_is_ceil_of_fraction_times_shards(fraction, shards, needed):
    spec = JobSpec.from_dict({**REQUIRED, "shards": shards, "min_accepted_fraction": fraction})
    assert spec.min_accepted_shards == needed


def test_from_dict_errors_name_the_field_without_a_location():
    with pytest.raises(SpecError) as caught:
        JobSpec.from_dict({**REQUIRED, "training": {"epochs": True}})
    assert str(caught.value) == "training.epochs: expected an integer from 1 to 10000, got true"
    with pytest.raises(SpecError) as caught:
        JobSpec.from_dict(["not", "a", "mapping"])
    assert str(caught.value) == "expected a mapping of job settings at the top level, got a list"
    with pytest.raises(SpecError) as caught:
        JobSpec.from_dict({**REQUIRED, 3: "x"})
    assert str(caught.value) == "keys must be names, got 3"


def test_giant_integers_are_described_not_printed():
    with pytest.raises(SpecError) as caught:
        JobSpec.from_dict({**REQUIRED, "seed": 10**5000})  # str() of it would raise ValueError
    assert str(caught.value) == "seed: expected an integer from 0 to 9007199254740992, got a 16610-bit integer"


def test_spec_is_frozen():
    spec = JobSpec.from_dict(REQUIRED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.training.epochs = 3  # type: ignore[misc]


# --- template, example, document ---------------------------------------------------------------


def test_template_parses_to_the_defaults():
    spec = parse_spec(TEMPLATE, "template")
    required = {"name": spec.name, "base_model": spec.base_model, "input": {"dataset": spec.input.dataset}}
    assert same_typed(spec.to_dict(), JobSpec.from_dict(required).to_dict())


def test_template_shows_every_key():
    for key in dotted_keys(JobSpec.from_dict(REQUIRED).to_dict()):
        leaf = key.rsplit(".", 1)[-1]
        assert re.search(rf"^\s*#?\s*{leaf}:", TEMPLATE, re.M), key


def test_example_file_is_the_template():
    assert (ROOT / "examples/infernet.train.yml").read_text() == TEMPLATE
    assert load_spec(ROOT / "examples/infernet.train.yml") == parse_spec(TEMPLATE)


def test_ipip_documents_every_key_and_quotes_real_errors():
    ipip = (ROOT / "ipips/0007-job-spec.md").read_text()
    for key in dotted_keys(JobSpec.from_dict(REQUIRED).to_dict()):
        assert f"`{key}`" in ipip, key
    errors = {c["error"] for c in INVALID["cases"]}
    quoted = [line for line in ipip.splitlines() if line.startswith(SOURCE)]
    assert quoted and all(line in errors for line in quoted)


# --- files -------------------------------------------------------------------------------------


def test_load_spec_names_the_file(tmp_path):
    path = tmp_path / "infernet.train.yml"
    path.write_text("name: a\nbase_model: b\ninput:\n  dataset: c\nlora:\n  rank: 0\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(caught.value) == f"{path}:6: lora.rank: expected an integer from 1 to 4096, got 0"


def test_load_spec_missing_file(tmp_path):
    path = tmp_path / "nope.yml"
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(caught.value) == f"{path}: cannot read: No such file or directory"


def test_load_spec_rejects_non_utf8_with_its_line(tmp_path):
    path = tmp_path / "x.yml"
    path.write_bytes(b"name: a\nbase_model: caf\xe9\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(caught.value) == f"{path}:2: not UTF-8 text (byte 0xe9 at offset 23)"


def test_size_is_capped_before_parsing(tmp_path):
    big = "# padding\n" * (jobspec.MAX_SPEC_BYTES // 10 + 1)
    with pytest.raises(SpecError) as caught:
        parse_spec(big, "big.yml")
    assert str(caught.value) == f"big.yml: larger than {jobspec.MAX_SPEC_BYTES} bytes"
    path = tmp_path / "big.yml"
    path.write_text(big)
    with pytest.raises(SpecError, match="larger than"):
        load_spec(path)
    # multi-byte characters count as bytes
    with pytest.raises(SpecError, match="larger than"):
        parse_spec("#" + "é" * (jobspec.MAX_SPEC_BYTES // 2 + 1))


# --- limits agree with the job terms -----------------------------------------------------------


def spec_at_every_maximum() -> JobSpec:
    return JobSpec.from_dict({
        "name": "n" * jobspec.MAX_NAME, "base_model": "m" * jobspec.MAX_NAME, "seed": jobspec.MAX_INT,
        "input": {"dataset": "d"},
        "training": {"epochs": 10_000, "batch_size": 65_536, "gradient_accumulation_steps": 65_536,
                     "max_seq_len": 1 << 20, "max_steps": jobspec.MAX_INT,
                     "first_round_steps": [jobspec.MAX_INT] * jobspec.MAX_FIRST_ROUNDS},
        "lora": {"rank": 4096, "target_modules": [f"{i:0>64}" for i in range(jobspec.MAX_MODULES)]},
        "proof": {"checkpoint_every": jobspec.MAX_INT, "verify_segments": 1024},
        "shards": jobspec.MAX_SHARDS, "rounds": 1000, "max_retries": 100, "lease_seconds": jobspec.MAX_INT,
    })


def test_a_spec_at_every_maximum_fits_the_job_terms():
    """If protocol/messages.py tightens a bound, this fails: a valid spec must always be announceable."""
    spec = spec_at_every_maximum().to_dict()
    cid = CID.for_block(b"shard", RAW).encode()
    wire = {
        "name": spec["name"], "submitter": Identity(bytes([7]) * 32).peer_id,
        "base_model": spec["base_model"], "base_model_sha256": bytes(32),
        "method": spec["method"], "runtime": spec["runtime"], "seed": spec["seed"],
        "shards": [{"index": i, "cid": cid, "records": 1, "size": 1} for i in range(spec["shards"])],
        "validation_cid": None,
        "training": m.TrainingTerms(**{k: tuple(v) if isinstance(v, list) else v
                                       for k, v in spec["training"].items()}).to_wire(),
        "lora": spec["lora"], "proof": spec["proof"],
        "rounds": spec["rounds"], "aggregation": spec["aggregation"],
        "min_accepted_fraction": spec["min_accepted_fraction"], "max_retries": spec["max_retries"],
        "lease_seconds": spec["lease_seconds"], "min_vram_gb": spec["resources"]["min_vram_gb"],
        "deadline": 1_790_000_000 + math.ceil(spec["resources"]["max_runtime_hours"] * 3600),
        "price_per_hour": spec["budget"]["price_per_hour"], "budget": spec["budget"]["total"],
        "created": 1_790_000_000,
    }
    if spec["outer"]["optimizer"] != "none":
        wire["outer"] = spec["outer"]
    m.JobTerms.from_wire(wire)


# --- fuzzing: nothing but SpecError ever escapes -----------------------------------------------

FULL = VALID["cases"][1]["canonical"]
KEY_PATHS = [tuple(k.split(".")) for k in dotted_keys(FULL)]

yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**53 + 1, 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def check_outcome(parse) -> None:
    try:
        spec = parse()
    except SpecError as error:
        assert "\n" not in str(error)
        return
    assert JobSpec.from_dict(spec.to_dict()) == spec


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEY_PATHS), st.sampled_from(["set", "delete", "add"]), yaml_values),
                min_size=1, max_size=3))
def test_mutated_specs_raise_nothing_but_spec_error(mutations):
    data = json.loads(json.dumps(FULL))
    for path, action, value in mutations:
        parent = data
        for part in path[:-1]:
            if not isinstance(parent.get(part), dict):
                break
            parent = parent[part]
        else:
            if action == "set":
                parent[path[-1]] = value
            elif action == "delete":
                parent.pop(path[-1], None)
            else:
                parent[path[-1] + "_x"] = value
    check_outcome(lambda: JobSpec.from_dict(data))
    check_outcome(lambda: parse_spec(yaml.safe_dump(data), SOURCE))


YAML_NOISE = st.text(alphabet=list(":-[]{},&*!?|>'\"#%@`\t\n \\") + ["0", "a", "é", "\x00", "\ufeff"], max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(TEMPLATE)), st.integers(0, 8), YAML_NOISE),
                min_size=1, max_size=4))
def test_edited_template_text_raises_nothing_but_spec_error(edits):
    text = TEMPLATE
    for at, cut, noise in edits:
        text = text[:at] + noise + text[at + cut:]
    check_outcome(lambda: parse_spec(text, SOURCE))


def test_one_mapping_from_spec_to_terms_to_training_config():
    """Issue 23: the spec's fields reach the terms in one place (to_terms) and the terms reach training
    in one place (TrainConfig.from_terms); a local run's config (from_spec) is the same mapping, with the
    spec's own learning rate, hash and validation split. Every field that differs from its default in the
    spec below must arrive in both."""
    from agent.train.config import TrainConfig
    from protocol.jobspec import parse_spec, to_terms

    spec = parse_spec("""
name: mapping
base_model: /models/x
base_model_sha256: "%s"
seed: 9
input: {dataset: d.jsonl, validation_split: 0.2}
training: {epochs: 2, learning_rate: 0.003, batch_size: 4, gradient_accumulation_steps: 3, max_seq_len: 77,
           max_steps: 40, schedule: cosine, warmup_rounds: 1, optimizer_state: carried}
lora: {rank: 5, alpha: 11, dropout: 0.05, target_modules: [q_proj, k_proj], freeze_a: true}
proof: {checkpoint_every: 5, verify_segments: 2, tolerance: 0.001}
rounds: 3
""" % ("ab" * 32))
    terms = to_terms(spec, submitter="", base_model_sha256=bytes.fromhex("ab" * 32), created=100)
    assert terms.deadline == 100 + int(spec.resources.max_runtime_hours * 3600)
    worker = TrainConfig.from_terms(terms, "/local/x", round=1, threads=1)
    local = TrainConfig.from_spec(spec, threads=1)
    expected = dict(seed=9, epochs=2, batch_size=4, gradient_accumulation_steps=3, max_seq_len=77, max_steps=40,
                    carry_optimizer=True, rank=5, alpha=11, dropout=0.05, target_modules=("q_proj", "k_proj"),
                    freeze_a=True, checkpoint_every=5, verify_segments=2, tolerance=0.001, base_model_sha256="ab" * 32)
    for name, value in expected.items():
        assert getattr(worker, name) == value, name
        assert getattr(local, name) == value, name
    assert worker.base_model == "/local/x" and local.base_model == "/models/x"
    assert local.learning_rate == 0.003 and local.validation_split == 0.2
    assert worker.learning_rate != local.learning_rate  # round 1 of a cosine schedule with a warm-up round
