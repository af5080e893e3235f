"""protocol.proof against the vectors in ipips/vectors/proof-*.json, plus its rules directly."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from protocol.errors import ProofError
from protocol.proof import (
    EMPTY_TENSOR_SET, FP32_TOLERANCE, HALF_TOLERANCE, ChainLink, Commitment, CommitmentHeader,
    TensorRecord, acceptance_tolerance, batches_digest, catch_probability, chain_heads,
    faked_segments, judge_replay, segment_selection_seed, select_segments, tensor_set_hash,
)
from tests.conftest import IPIP_VECTORS


def load(name: str) -> dict:
    return json.loads((IPIP_VECTORS / name).read_text(encoding="utf-8"))


def records(raw: list[dict]) -> list[TensorRecord]:
    return [TensorRecord(r["name"], r["dtype"], tuple(r["shape"]), bytes.fromhex(r["data"])) for r in raw]


TENSORS = load("proof-tensors.json")
CHAIN = load("proof-chain.json")
SEGMENTS = load("proof-segments.json")


@pytest.mark.parametrize("case", TENSORS["cases"], ids=lambda c: c["description"])
def test_tensor_set_hash_vectors(case):
    assert tensor_set_hash(records(case["records"])).hex() == case["hash"]
    assert tensor_set_hash(reversed(records(case["records"]))).hex() == case["hash"]


def test_tensor_set_hash_is_order_free_but_binds_dtype_and_shape():
    by_description = {c["description"]: c["hash"] for c in TENSORS["cases"]}
    assert len(set(by_description.values())) == len(by_description) - 1  # only the reordered pair agree
    assert by_description["two tensors given out of order; hash sorts by name"] == \
        by_description["same two tensors in sorted order: same hash"]
    assert EMPTY_TENSOR_SET.hex() == TENSORS["cases"][0]["hash"]


@pytest.mark.parametrize("case", TENSORS["errors"], ids=lambda c: c["description"])
def test_tensor_set_hash_rejects(case):
    with pytest.raises(ProofError, match=case["error"]):
        tensor_set_hash(records(case["records"]))


@pytest.mark.parametrize("case", TENSORS["batches_digest"], ids=lambda c: str(c["steps"]))
def test_batches_digest_vectors(case):
    assert batches_digest(case["steps"]).hex() == case["digest"]


def test_chain_vectors():
    header = CommitmentHeader.from_json(CHAIN["header"])
    assert header.genesis().hex() == CHAIN["genesis"]
    links = [ChainLink.from_json(link) for link in CHAIN["links"]]
    assert [h.hex() for h in chain_heads(header.genesis(), links)] == CHAIN["heads"]
    commitment = Commitment(header, tuple(links))
    commitment.check(bytes.fromhex(CHAIN["heads"][-1]))
    assert Commitment.from_json(commitment.to_json()) == commitment


def test_every_link_field_moves_the_head():
    header = CommitmentHeader.from_json(CHAIN["header"])
    link = ChainLink.from_json(CHAIN["links"][0])
    head = link.extend(header.genesis())
    other = bytes(32)
    for changed in (replace(link, step=11), replace(link, adapter_hash=other), replace(link, optimizer_hash=other),
                    replace(link, batches_digest=other), replace(link, loss=math.nextafter(link.loss, 3.0))):
        assert changed.extend(header.genesis()) != head
    assert link.extend(other) != head
    for field, value in (("worker", "someone else"), ("shard", 4), ("seed", 1), ("environment", {})):
        assert replace(header, **{field: value}).genesis() != header.genesis()


@pytest.mark.parametrize("bad", CHAIN["bad_chains"], ids=lambda b: b["description"])
def test_commitment_check_rejects_bad_step_sequences(bad):
    header = CommitmentHeader.from_json(CHAIN["header"])
    template = ChainLink.from_json(CHAIN["links"][0])
    links = tuple(replace(template, step=s) for s in bad["steps"])
    with pytest.raises(ProofError, match=bad["error"]):
        Commitment(header, links).check()


def test_commitment_check_rejects_wrong_head_and_bad_loss():
    commitment = Commitment(CommitmentHeader.from_json(CHAIN["header"]),
                            tuple(ChainLink.from_json(link) for link in CHAIN["links"]))
    with pytest.raises(ProofError, match="does not match"):
        commitment.check(bytes(32))
    with pytest.raises(ProofError, match="finite"):
        replace(commitment.links[0], loss=float("nan")).extend(bytes(32))
    data = commitment.to_json()
    data["links"][1]["loss"] = 1.5  # the head no longer fits
    with pytest.raises(ProofError):
        Commitment.from_json(data)


def test_segment_start_points():
    commitment = Commitment(CommitmentHeader.from_json(CHAIN["header"]),
                            tuple(ChainLink.from_json(link) for link in CHAIN["links"]))
    assert commitment.segment_start(0) == (0, commitment.header.initial_adapter_hash, EMPTY_TENSOR_SET)
    assert commitment.segment_start(2) == (20, commitment.links[1].adapter_hash, commitment.links[1].optimizer_hash)
    with pytest.raises(ProofError, match="out of range"):
        commitment.segment_start(3)


@pytest.mark.parametrize("case", SEGMENTS["selections"], ids=lambda c: f"n{c['n_segments']}k{c['k']}-{c['nonce']}")
def test_segment_selection_vectors(case):
    seed = segment_selection_seed(bytes.fromhex(case["final_head"]), bytes.fromhex(case["nonce"]))
    assert seed.hex() == case["seed"]
    chosen = select_segments(seed, case["n_segments"], case["k"])
    assert list(chosen) == case["indices"]
    assert len(set(chosen)) == min(case["k"], case["n_segments"])


def test_segment_selection_is_uniform():
    counts: Counter[int] = Counter()
    rng = random.Random(7)
    trials = 4000
    for _ in range(trials):
        counts.update(select_segments(rng.randbytes(32), 10, 3))
    expected = trials * 3 / 10
    assert all(abs(counts[i] - expected) < 0.1 * expected for i in range(10)), counts


@pytest.mark.parametrize("row", SEGMENTS["catch_probability"], ids=lambda r: f"n{r['n']}f{r['f']}k{r['k']}")
def test_catch_probability_table(row):
    assert faked_segments(row["n"], row["f"]) == row["m"]
    assert catch_probability(row["n"], row["k"], row["m"]) == pytest.approx(row["p"], abs=1e-12)


def test_catch_probability_edges_and_simulation():
    assert faked_segments(30, 0.1) == 3  # not 4: 0.1 * 30 is read as the decimal
    assert catch_probability(10, 3, 0) == 0.0
    assert catch_probability(10, 10, 1) == 1.0
    assert catch_probability(10, 1, 1) == pytest.approx(0.1)
    rng = random.Random(3)
    n, k, m, trials = 20, 4, 3, 20000
    caught = sum(bool(set(rng.sample(range(n), k)) & set(range(m))) for _ in range(trials))
    assert caught / trials == pytest.approx(catch_probability(n, k, m), abs=0.015)


ENV = CHAIN["header"]["environment"]


def test_acceptance_tolerance_rule():
    assert acceptance_tolerance(ENV, dict(ENV)) == 0.0
    assert acceptance_tolerance(ENV, dict(ENV), spec_tolerance=0.01) == 0.0  # same env: exact regardless
    other_threads = {**ENV, "threads": 8}
    assert acceptance_tolerance(ENV, other_threads) == FP32_TOLERANCE
    assert acceptance_tolerance(ENV, other_threads, spec_tolerance=1e-3) == 1e-3
    bf16 = {**ENV, "dtype": "bfloat16"}
    assert acceptance_tolerance(bf16, dict(bf16)) == HALF_TOLERANCE  # bf16 never replays exactly
    gpu = {**ENV, "device": "cuda:NVIDIA H100"}
    assert acceptance_tolerance(gpu, dict(gpu)) == FP32_TOLERANCE
    with pytest.raises(ProofError):
        acceptance_tolerance(ENV, other_threads, spec_tolerance=2.0)


def test_judge_replay():
    committed = ChainLink.from_json(CHAIN["links"][1])
    assert judge_replay(1, committed, committed, 0.0).accepted
    drifted = replace(committed, adapter_hash=bytes(32), loss=committed.loss * (1 + 1e-7))
    assert not judge_replay(1, committed, drifted, 0.0).accepted  # exact mode
    undecided = judge_replay(1, committed, drifted, 1e-4)  # no distances to judge by: the end checkpoint is wanted
    assert not undecided.accepted and undecided.needs_end
    assert not judge_replay(1, committed, drifted, 0.0).needs_end  # exact mode: nothing to measure, rejected
    assert not judge_replay(1, committed, replace(drifted, loss=committed.loss * 1.5), 1e-4).needs_end  # the loss alone rejects
    close = judge_replay(1, committed, drifted, 1e-4, {"a": 3e-6, "b": 1e-5})
    assert close.accepted and not close.exact and close.max_distance == 1e-5
    far = judge_replay(1, committed, drifted, 1e-4, {"a": 3e-6, "b": 2e-3})
    assert not far.accepted and "b" in far.reason
    other_batches = replace(committed, batches_digest=bytes(32))
    assert "batch" in judge_replay(1, committed, other_batches, 1e-4, {"a": 0.0}).reason
    wrong_loss = replace(committed, loss=committed.loss * 1.01)
    assert not judge_replay(1, committed, wrong_loss, 1e-4, {"a": 0.0}).accepted


# --- the training's randomness (IPIP-0005 §6) -----------------------------------------------------

RANDOMNESS = load("proof-randomness.json")


def test_training_randomness_vectors():
    from protocol import proof
    for c in RANDOMNESS["epoch_order"]:
        assert list(proof.epoch_order(c["n"], c["seed"], c["epoch"])) == c["order"]
    for c in RANDOMNESS["step_seed"]:
        assert proof.step_seed(c["seed"], c["step"]) == c["value"] < 2**63
    for c in RANDOMNESS["micro_seed"]:
        assert proof.micro_seed(c["seed"], c["step"], c["micro"]) == c["value"] < 2**63
    for c in RANDOMNESS["lora_a_seed"]:
        assert proof.lora_a_seed(c["seed"], c["module"]) == c["value"] < 2**64
    for c in RANDOMNESS["errors"]:
        with pytest.raises(ProofError, match=c["error"].replace("^", r"\^")):
            getattr(proof, c["rule"])(*c["args"])


def test_training_randomness_separates_what_it_seeds():
    """Each rule has its own domain: a step seed never equals a micro-batch seed of the same (seed, step),
    epochs give different orders, and every order is a permutation."""
    from protocol import proof
    assert len({proof.step_seed(7, 3), *(proof.micro_seed(7, 3, j) for j in range(8))}) == 9
    orders = {proof.epoch_order(50, 7, e) for e in range(4)}
    assert len(orders) == 4 and all(sorted(o) == list(range(50)) for o in orders)
    assert proof.lora_a_seed(7, "a.q_proj") != proof.lora_a_seed(8, "a.q_proj") != proof.lora_a_seed(8, "a.v_proj")


def test_the_trainer_uses_the_protocol_rules():
    """agent/train draws with protocol.proof's rules, not copies of them (a copy could drift)."""
    from agent.train import data, loop, model
    from protocol import proof
    assert loop.step_seed is proof.step_seed and loop.micro_seed is proof.micro_seed
    assert model.lora_a_seed is proof.lora_a_seed
    assert data.epoch_order(10, 3, 1) == proof.epoch_order(10, 3, 1)
