"""A round's aggregate is a pure function of what the protocol publishes (IPIP-0006 §2.3, §2.4):
a successor coordinator that holds only the previous round's published bundle makes the same bytes
as the coordinator that ran every round. This is what lets a failover keep the final aggregate."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agent.combine import aggregate_adapters
from agent.train.aggregate import OPTIMIZER_FILE, OUTER_STATE_FILE
from protocol import messages as m
from scripts.make_envelope_vectors import sample_terms
from protocol.identity import Identity

B = "base_model.model.layers.0.q_proj.lora_B.weight"
A = "base_model.model.layers.0.q_proj.lora_A.weight"


def worker_output(directory: Path, seed: int) -> Path:
    """What an accepted worker's report bundle holds: adapter (A frozen) and its final AdamW state."""
    g = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True)
    save_file({A: torch.ones(4, 8), B: torch.randn(16, 4, generator=g)}, str(directory / "adapter_model.safetensors"))
    save_file({f"{B}.exp_avg": torch.randn(16, 4, generator=g), f"{B}.exp_avg_sq": torch.rand(16, 4, generator=g),
               f"{B}.step": torch.tensor(12.0)}, str(directory / OPTIMIZER_FILE))
    (directory / "adapter_config.json").write_text(json.dumps({"r": 4}))
    return directory


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def start_from(directory: Path | None) -> tuple[dict, dict, dict]:
    """The round's start as a coordinator reads it from the previous aggregate's bundle."""
    if directory is None:
        return {A: torch.ones(4, 8), B: torch.zeros(16, 4)}, {}, {}
    outer = directory / OUTER_STATE_FILE
    return (load_file(str(directory / "adapter_model.safetensors")),
            load_file(str(outer)) if outer.exists() else {}, load_file(str(directory / OPTIMIZER_FILE)))


def test_a_successor_coordinator_makes_the_same_aggregate_from_the_published_bundle(tmp_path):
    terms = dataclasses.replace(
        sample_terms(Identity(bytes([1]) * 32)), aggregation="exact", outer=m.OuterTerms("nesterov", 0.7, 0.9, 0.9, 0.99),
        training=dataclasses.replace(sample_terms(Identity(bytes([1]) * 32)).training, optimizer_state="carried"),
        lora=dataclasses.replace(sample_terms(Identity(bytes([1]) * 32)).lora, freeze_a=True))
    rounds = {r: [(worker_output(tmp_path / f"r{r}w{i}", 10 * r + i), 5 + i) for i in range(3)] for r in (1, 2, 3)}

    # the first coordinator runs every round
    previous = None
    for r in (1, 2, 3):
        out = tmp_path / f"first-r{r}"
        aggregate_adapters(terms, rounds[r], out, r, start_from(previous))
        previous = out
    # round 1's coordinator dies after publishing; its successor has only the published bundle
    published = tmp_path / "fetched-r1"
    shutil.copytree(tmp_path / "first-r1", published)
    previous = published
    for r in (2, 3):
        out = tmp_path / f"second-r{r}"
        aggregate_adapters(terms, rounds[r], out, r, start_from(previous))
        previous = out
    assert digest(tmp_path / "second-r3") == digest(tmp_path / "first-r3")
    assert set(digest(tmp_path / "first-r3")) == {"adapter_config.json", "adapter_model.safetensors",
                                                   OPTIMIZER_FILE, OUTER_STATE_FILE}
    # and the state matters: a successor that lost the outer momentum would publish other bytes
    lost = start_from(published)
    aggregate_adapters(terms, rounds[2], tmp_path / "lost-r2", 2, (lost[0], {}, lost[2]))
    assert digest(tmp_path / "lost-r2")["adapter_model.safetensors"] != digest(tmp_path / "first-r2")["adapter_model.safetensors"]


def test_a_report_must_carry_the_optimizer_state_its_proof_committed(tmp_path):
    from agent.roles.coordinator import _check_final_optimizer
    from agent.train.model import tensors_hash

    report = worker_output(tmp_path / "report", 1)
    committed = tensors_hash(load_file(str(report / OPTIMIZER_FILE)))
    assert _check_final_optimizer(report, committed) is None
    state = load_file(str(report / OPTIMIZER_FILE))
    state[f"{B}.exp_avg"][0, 0] += 1e-3  # a worker that edits its momentum after committing
    save_file(state, str(report / OPTIMIZER_FILE))
    assert "does not hash to the last committed checkpoint" in _check_final_optimizer(report, committed)
    (report / OPTIMIZER_FILE).unlink()
    assert "has no optimizer.safetensors" in _check_final_optimizer(report, committed)


def test_a_coded_report_materializes_to_the_state_its_worker_holds(tmp_path):
    """IPIP-0006 §2.8: the coordinator decodes a report's int8 payload onto the round's start and
    gets exactly the state the worker's round trip left it with (which its last link commits); a
    coded job's report with whole tensors, or an uncoded job's with a payload, is refused."""
    import pytest

    from agent.combine import Rejection, materialize_report
    from agent.train.codec import PAYLOAD_FILE, round_trip, save_payload
    from agent.train.model import tensors_hash

    base = sample_terms(Identity(bytes([1]) * 32))
    terms = dataclasses.replace(base, aggregation="exact", lora=dataclasses.replace(base.lora, freeze_a=True),
                                training=dataclasses.replace(base.training, optimizer_state="carried",
                                                             report_codec="int8"))
    whole = worker_output(tmp_path / "whole", 3)
    start = {A: torch.ones(4, 8), B: torch.zeros(16, 4)}
    payload, adapter, optimizer = round_trip(start, load_file(str(whole / "adapter_model.safetensors")),
                                             load_file(str(whole / OPTIMIZER_FILE)), [A])
    coded = tmp_path / "coded"
    coded.mkdir()
    shutil.copy(whole / "adapter_config.json", coded)
    save_payload(coded / PAYLOAD_FILE, payload)
    materialize_report(coded, terms, start)
    assert tensors_hash(load_file(str(coded / "adapter_model.safetensors"))) == tensors_hash(adapter)
    assert tensors_hash(load_file(str(coded / OPTIMIZER_FILE))) == tensors_hash(optimizer)
    with pytest.raises(Rejection, match="reports are coded"):
        materialize_report(whole, terms, start)  # whole tensors where the job codes them
    plain = dataclasses.replace(terms, training=dataclasses.replace(terms.training, report_codec="none"))
    with pytest.raises(Rejection, match="whole reports"):
        materialize_report(coded, plain, start)
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(whole / "adapter_config.json", broken)
    save_file({k: v for k, v in payload.items() if not k.startswith("optimizer/")}, str(broken / PAYLOAD_FILE),
              metadata={"format": "infernet-report-int8/1"})
    (broken / OPTIMIZER_FILE).unlink(missing_ok=True)
    materialize_report(broken, terms, start)  # decodes; the missing state then fails the chain's hash
    assert not (broken / OPTIMIZER_FILE).exists()
