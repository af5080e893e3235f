"""A coded aggregate (IPIP-0006 §2.8.1): the coordinator writes the decoded state as the aggregate and serves the
update beside it; a peer holding the round's start rebuilds the aggregate's bundle bit for bit from the update
and checks its CID, and falls back to the whole aggregate when it cannot.

Real content services on loopback and real safetensors files; the job's terms are a plain record of the three
fields these functions read.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio
from safetensors.torch import load_file, save_file

from agent.bundle import pack_dir
from agent.downlink import code_aggregate, fetch_coded, rebuild
from agent.train.aggregate import OPTIMIZER_FILE
from agent.train.codec import PAYLOAD_FILE, CodecError, load_payload
from tests.net.conftest import agents_with_content

MODULES = [f"base_model.model.model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qv"]


def _terms(codec: str = "int4-fresh", carried: bool = True, freeze_a: bool = True):
    return SimpleNamespace(training=SimpleNamespace(aggregate_codec=codec,
                                                    optimizer_state="carried" if carried else "fresh"),
                           lora=SimpleNamespace(freeze_a=freeze_a))


def _state(seed: int, steps: float, like: dict | None = None) -> tuple[dict, dict]:
    """An adapter (A frozen: the same in every state) and its AdamW state after ``steps`` steps."""
    g = torch.Generator().manual_seed(seed)
    adapter, optimizer = {}, {}
    for module in MODULES:
        a_key, b_key = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        adapter[a_key] = like[a_key] if like else torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
        adapter[b_key] = torch.randn(512, 8, generator=g) * 0.01
        for key in (a_key, b_key):
            shape = adapter[key].shape
            optimizer[f"{key}.exp_avg"] = torch.randn(shape, generator=g) * 1e-3
            optimizer[f"{key}.exp_avg_sq"] = torch.rand(shape, generator=g) * 1e-6
            optimizer[f"{key}.step"] = torch.tensor(steps)
    return adapter, optimizer


def _write_aggregate(directory: Path, adapter: dict, optimizer: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_file(optimizer, str(directory / OPTIMIZER_FILE), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj", "v_proj"]}\n')
    return directory


def _round(tmp_path: Path, terms) -> tuple[Path, Path, Path]:
    """(the round's start, the coordinator's coded aggregate, its update), as directories."""
    start = _write_aggregate(tmp_path / "start", *_state(1, 24.0))
    adapter, _ = _state(1, 24.0)
    combined = _write_aggregate(tmp_path / "aggregate", *_state(2, 36.0, like=adapter))
    start_adapter, start_optimizer = load_file(str(start / "adapter_model.safetensors")), \
        load_file(str(start / OPTIMIZER_FILE))
    code_aggregate(terms, combined, tmp_path / "update", start_adapter, start_optimizer)
    return start, combined, tmp_path / "update"


def test_a_holder_of_the_start_rebuilds_the_coordinators_aggregate_bit_for_bit(tmp_path):
    terms = _terms()
    start, aggregate, update = _round(tmp_path, terms)
    combined, _ = _state(2, 36.0, like=_state(1, 24.0)[0])
    coded = load_file(str(aggregate / "adapter_model.safetensors"))
    # the aggregate is now the coded state: near the combined one, not it (int4 deltas)
    key = f"{MODULES[0]}.lora_B.weight"
    assert not torch.equal(coded[key], combined[key])
    step = (combined[key] - load_file(str(start / "adapter_model.safetensors"))[key]).abs().max() / 7
    assert torch.allclose(coded[key], combined[key], atol=float(step) / 2 + 1e-6)  # within half a 4-bit step
    assert load_payload(update / PAYLOAD_FILE, "int4-fresh", kind="update")
    with pytest.raises(CodecError):  # an update is not a report
        load_payload(update / PAYLOAD_FILE, "int4-fresh")
    rebuild(terms, update, load_file(str(start / "adapter_model.safetensors")), load_file(str(start / OPTIMIZER_FILE)),
            tmp_path / "rebuilt")
    for name in ("adapter_model.safetensors", OPTIMIZER_FILE, "adapter_config.json"):
        assert (tmp_path / "rebuilt" / name).read_bytes() == (aggregate / name).read_bytes(), name
    assert pack_dir(tmp_path / "rebuilt", tmp_path / "a.tar").read_bytes() == \
        pack_dir(aggregate, tmp_path / "b.tar").read_bytes()
    # update bytes: a ninth or so of the aggregate's (4-bit codes, a scale per 64 values)
    whole = sum((aggregate / n).stat().st_size for n in ("adapter_model.safetensors", OPTIMIZER_FILE))
    assert (update / PAYLOAD_FILE).stat().st_size < whole / 5


def test_an_update_onto_another_start_or_tampered_does_not_decode_or_gives_other_bytes(tmp_path):
    terms = _terms()
    start, aggregate, update = _round(tmp_path, terms)
    other_adapter, other_optimizer = _state(5, 24.0)
    rebuild(terms, update, other_adapter, other_optimizer, tmp_path / "other")
    assert (tmp_path / "other" / "adapter_model.safetensors").read_bytes() != \
        (aggregate / "adapter_model.safetensors").read_bytes()
    payload = load_file(str(update / PAYLOAD_FILE))
    payload.pop(next(k for k in payload if k.endswith(".scale")))
    save_file(payload, str(update / PAYLOAD_FILE), metadata={"format": "infernet-update-int4-fresh/1", "block": "64"})
    with pytest.raises(CodecError, match="missing from the payload"):
        rebuild(terms, update, load_file(str(start / "adapter_model.safetensors")),
                load_file(str(start / OPTIMIZER_FILE)), tmp_path / "tampered")


@pytest.mark.network
async def test_fetch_coded_rebuilds_from_the_seeds_update_and_falls_back_when_it_cannot(tmp_path):
    terms = _terms()
    start, aggregate, update = _round(tmp_path / "coordinator", terms)
    async with agents_with_content(3, tmp_path / "rooms") as [(seed, seed_content), (holder, holder_content),
                                                               (newcomer, newcomer_content)]:
        start_cid = str(await seed_content.add_file(pack_dir(start, tmp_path / "start.tar"), provide=False))
        cid = str(await seed_content.add_file(pack_dir(aggregate, tmp_path / "aggregate.tar"), provide=False))
        update_cid = str(await seed_content.add_file(pack_dir(update, tmp_path / "update.tar"), provide=False))
        assert str(await holder_content.add_file(tmp_path / "start.tar", provide=False)) == start_cid
        served = seed_content.server.bytes_served
        with trio.fail_after(30):
            out = tmp_path / "holder" / "initial.tar"
            assert await fetch_coded(holder_content, terms, cid=cid, update_cid=update_cid, base_cid=start_cid, out=out,
                                     providers=[seed.peer_id], work=tmp_path / "holder" / "work")
        assert out.read_bytes() == (tmp_path / "aggregate.tar").read_bytes()
        assert seed_content.server.bytes_served - served == (tmp_path / "update.tar").stat().st_size
        assert not (tmp_path / "holder" / "work").exists()
        # now held: read from the store, as any held file
        assert await holder_content.read_local(cid, tmp_path / "again.tar")
        with trio.fail_after(30):
            # a newcomer lacks the round's start: nothing fetched, the caller takes the whole aggregate
            assert not await fetch_coded(newcomer_content, terms, cid=cid, update_cid=update_cid, base_cid=start_cid,
                                         out=tmp_path / "newcomer" / "initial.tar", providers=[seed.peer_id],
                                         work=tmp_path / "newcomer" / "work")
            assert not (tmp_path / "newcomer" / "initial.tar").exists()
            # an update that rebuilds another bundle than the one announced (decoded onto another start) is
            # refused, and nothing is written
            other = _write_aggregate(tmp_path / "other", *_state(5, 24.0))
            other_cid = str(await holder_content.add_file(pack_dir(other, tmp_path / "other.tar"), provide=False))
            assert not await fetch_coded(holder_content, terms, cid=str(await seed_content.add_bytes(b"x" * 100)),
                                         update_cid=update_cid, base_cid=other_cid,
                                         out=tmp_path / "holder2" / "initial.tar", providers=[seed.peer_id],
                                         work=tmp_path / "holder2" / "work")
            assert not (tmp_path / "holder2" / "initial.tar").exists()
