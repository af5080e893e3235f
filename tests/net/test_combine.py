"""A round's aggregate computed by a worker (agent/combine.py, IPIP-0006 §2.9.1): from the round's coded reports,
its own held and the others fetched from their workers, and the round's start it holds, a worker writes the
coordinator's aggregate bundle bit for bit; a report that is not the announced round's gives another CID, and the
worker then holds nothing (it fetches the aggregate).

Real content services on loopback and real safetensors files; the job's terms are a plain record of the fields
these functions read.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from agent.bundle import pack_dir
from agent.combine import aggregate_adapters, combine_here, materialize_report
from agent.downlink import code_aggregate
from agent.train.aggregate import frozen_keys
from agent.train.codec import PAYLOAD_FILE, encode, save_payload
from tests.net.conftest import agents_with_content
from tests.net.test_downlink import _state

pytestmark = pytest.mark.network


def _terms(aggregate_codec: str):
    return SimpleNamespace(
        method="lora", rounds=4, aggregation="fedavg", outer=None,
        training=SimpleNamespace(report_codec="int4-fresh", aggregate_codec=aggregate_codec, optimizer_state="carried"),
        lora=SimpleNamespace(freeze_a=True))


def _report(directory: Path, terms, start: tuple[dict, dict], seed: int) -> Path:
    """A worker's coded report of a round from ``start`` (its payload and adapter config), as a directory."""
    end, end_optimizer = _state(seed, 36.0, like=start[0])
    payload = encode(start[0], end, end_optimizer, frozen_keys(start[0], True), "int4-fresh", start[1])
    directory.mkdir(parents=True)
    save_payload(directory / PAYLOAD_FILE, payload, "int4-fresh")
    (directory / "adapter_config.json").write_text('{"r": 8, "target_modules": ["v_proj", "q_proj"]}\n')
    return directory


def _coordinators_aggregate(tmp_path: Path, terms, start: tuple[dict, dict], reports: list[tuple[Path, int]]) -> Path:
    """The coordinator's computation (agent/roles/coordinator.py ``_combine``) on copies of the reports."""
    inputs = []
    for i, (report, samples) in enumerate(reports):
        copy = tmp_path / f"checked-{i}"
        copy.mkdir(parents=True)
        for file in report.iterdir():
            (copy / file.name).write_bytes(file.read_bytes())
        materialize_report(copy, terms, start[0], start[1])
        inputs.append((copy, samples))
    out = tmp_path / "aggregate"
    aggregate_adapters(terms, inputs, out, 2, (start[0], {}, start[1]))
    if terms.training.aggregate_codec != "none":
        code_aggregate(terms, out, tmp_path / "update", start[0], start[1])
    return pack_dir(out, tmp_path / "aggregate.tar")


@pytest.mark.parametrize("aggregate_codec", ["none", "int4-fresh"])
async def test_a_worker_computes_the_coordinators_aggregate_from_the_rounds_reports(tmp_path, aggregate_codec):
    terms = _terms(aggregate_codec)
    start = _state(1, 24.0)
    mine, theirs = _report(tmp_path / "r0", terms, start, 2), _report(tmp_path / "r1", terms, start, 3)
    expected = _coordinators_aggregate(tmp_path / "coordinator", terms, start, [(mine, 40), (theirs, 24)])
    async with agents_with_content(2, tmp_path / "rooms") as [(me, my_content), (other, other_content)]:
        my_cid = str(await my_content.add_file(pack_dir(mine, tmp_path / "r0.tar"), provide=False))
        their_cid = str(await other_content.add_file(pack_dir(theirs, tmp_path / "r1.tar"), provide=False))
        cid = str(await other_content.add_file(expected, provide=False))  # what the coordinator announced
        rounds_start = (start[0], {}, start[1])
        reports = [(my_cid, me.peer_id, 40), (their_cid, other.peer_id, 24)]
        served = other_content.server.bytes_served
        with trio.fail_after(30):
            out = tmp_path / "me" / "initial.tar"
            assert await combine_here(my_content, terms, rnd=2, cid=cid, out=out, start=rounds_start, reports=reports,
                                      work=tmp_path / "me" / "work", coordinator=None, timeout=20)
        assert out.read_bytes() == expected.read_bytes()
        # only the other worker's report came over the network
        assert other_content.server.bytes_served - served == (tmp_path / "r1.tar").stat().st_size
        assert not (tmp_path / "me" / "work").exists()
        assert await my_content.read_local(cid, tmp_path / "again.tar")  # held, and served as any held file
        announced = str(await other_content.add_bytes(b"another aggregate"))
        with trio.fail_after(30):
            # what these reports combine to is not the announced aggregate: nothing is written
            assert not await combine_here(my_content, terms, rnd=2, cid=announced, out=tmp_path / "me2" / "initial.tar",
                                          start=rounds_start, reports=reports, work=tmp_path / "me2" / "work",
                                          coordinator=None, timeout=20)
            assert not (tmp_path / "me2" / "initial.tar").exists() and not (tmp_path / "me2" / "work").exists()
            # a "report" that is not a report bundle: not computed, nothing written
            lost = [(my_cid, me.peer_id, 40), (announced, other.peer_id, 24)]  # (not a report bundle)
            assert not await combine_here(my_content, terms, rnd=2, cid=str(await other_content.add_bytes(b"x" * 99)),
                                          out=tmp_path / "me3" / "initial.tar", start=rounds_start, reports=lost,
                                          work=tmp_path / "me3" / "work", coordinator=None, timeout=5)
            assert not (tmp_path / "me3" / "initial.tar").exists()
