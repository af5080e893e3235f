"""IPIP-0006 §2.8.1 vectors (ipips/vectors/downlink.json): which rounds' aggregates are coded, and the coded
aggregate and update payload a coordinator writes from a start and a combined state, to the bit."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent.downlink import code_aggregate, rebuild
from agent.train.codec import PAYLOAD_FILE
from protocol.downlink import coded, update_base

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "ipips/vectors/downlink.json").read_text())


def _terms(codec: str, method: str = "lora", rounds: int = 4):
    return SimpleNamespace(method=method, rounds=rounds,
                           training=SimpleNamespace(aggregate_codec=codec, optimizer_state="carried"),
                           lora=SimpleNamespace(freeze_a=True))


def _tensors(doc: dict) -> dict:
    return {k: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"]) for k, v in doc.items()}


@pytest.mark.parametrize("case", VECTORS["coded"], ids=lambda c: c["name"])
def test_which_rounds_are_coded(case):
    assert coded(_terms(case["aggregate_codec"], case["method"], case["rounds"]), case["round"]) is case["coded"]


@pytest.mark.parametrize("case", VECTORS["base"], ids=lambda c: c["name"])
def test_onto_which_start_an_update_decodes(case):
    aggregates = {k: SimpleNamespace(adapter_cid=f"aggregate-r{k}") for k in case["published"]}
    assert update_base(_terms(case["aggregate_codec"], rounds=case["rounds"]), aggregates, case["round"]) == case["base"]


def test_the_coordinators_coded_aggregate_and_update_and_a_holders_rebuild(tmp_path):
    doc = VECTORS["round"]
    out, update = tmp_path / "aggregate", tmp_path / "update"
    out.mkdir()
    save_file(_tensors(doc["combined"]["adapter"]), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_file(_tensors(doc["combined"]["optimizer"]), str(out / "optimizer.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text("{}\n")
    start, start_optimizer = _tensors(doc["start"]["adapter"]), _tensors(doc["start"]["optimizer"])
    code_aggregate(_terms(doc["codec"]), out, update, start, start_optimizer)
    payload = load_file(str(update / PAYLOAD_FILE))
    assert {k: t.contiguous().numpy().tobytes().hex() for k, t in payload.items()} == \
        {k: v["hex"] for k, v in doc["payload"].items()}
    for name, expected in (("adapter_model.safetensors", doc["aggregate"]["adapter"]),
                           ("optimizer.safetensors", doc["aggregate"]["optimizer"])):
        got = load_file(str(out / name))
        assert got.keys() == expected.keys()
        for key, tensor in _tensors(expected).items():
            assert torch.equal(got[key], tensor), key
    rebuild(_terms(doc["codec"]), update, start, start_optimizer, tmp_path / "rebuilt")
    for name in ("adapter_model.safetensors", "optimizer.safetensors", "adapter_config.json"):
        assert (tmp_path / "rebuilt" / name).read_bytes() == (out / name).read_bytes()
