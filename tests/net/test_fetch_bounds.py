"""Every fetch is bounded (IPIP-0003 "Size bounds"): a file whose root states more than the bound
is refused at its root, before its leaves cross the network, with an error naming the CID."""

import os

import pytest
import trio

from agent.content.errors import FetchError
from agent.content.service import VIA_BITSWAP, VIA_BLOCKS
from protocol.unixfs import import_bytes
from tests.net.conftest import agents_with_content

pytestmark = pytest.mark.network

MiB = 1024 * 1024


@pytest.mark.parametrize("via", [VIA_BLOCKS, VIA_BITSWAP])
async def test_an_oversized_file_is_refused_at_its_root_before_its_leaves_arrive(tmp_path, via):
    data = os.urandom(8 * MiB)
    root, blocks = import_bytes(data)
    leaves = [b.cid for b in blocks if b.cid != root]
    async with agents_with_content(3, tmp_path) as [_, (a, a_content), (b, b_content)]:
        await a_content.add_bytes(data, provide=False)
        with trio.fail_after(20), pytest.raises(FetchError) as err:
            await b_content.fetch(root, tmp_path / "out.bin", providers=[a.peer_id], use_dht=False,
                                  via=via, max_size=1 * MiB)
        message = str(err.value)
        assert err.value.refused and str(root) in message and f"{len(data)} bytes" in message
        assert f"limit of {MiB}" in message and "\n" not in message
        assert not any(b_content.store.has(cid) for cid in leaves), "no leaf was taken"
        assert not (tmp_path / "out.bin").exists()
        if via == VIA_BLOCKS:  # the stream was reset at the root: the server did not get to send it all
            await trio.sleep(0.5)
            assert a_content.server.blocks_served < len(blocks), (a_content.server.blocks_served, len(blocks))
        # a bound that holds: the same file comes whole
        with trio.fail_after(30):
            report = await b_content.fetch(root, tmp_path / "ok.bin", providers=[a.peer_id], use_dht=False,
                                           via=via, max_size=len(data))
        assert report.size == len(data) and (tmp_path / "ok.bin").read_bytes() == data


async def test_a_shard_must_be_exactly_the_size_its_ref_states(tmp_path):
    data = os.urandom(MiB + 7)
    async with agents_with_content(2, tmp_path) as [(a, a_content), (b, b_content)]:
        root = await a_content.add_bytes(data, provide=False)
        for wrong in (len(data) - 1, len(data) + 1):
            with trio.fail_after(20), pytest.raises(FetchError, match=f"not the {wrong} it must be") as err:
                await b_content.fetch(root, tmp_path / "shard.jsonl", providers=[a.peer_id], use_dht=False,
                                      exact_size=wrong)
            assert err.value.refused and str(root) in str(err.value)
        with trio.fail_after(30):
            report = await b_content.fetch(root, tmp_path / "shard.jsonl", providers=[a.peer_id], use_dht=False,
                                           exact_size=len(data))
        assert report.size == len(data)


async def test_a_root_already_held_is_judged_by_the_bound_too(tmp_path):
    data = os.urandom(2 * MiB)
    async with agents_with_content(1, tmp_path) as [(a, a_content)]:
        root = await a_content.add_bytes(data, provide=False)
        with trio.fail_after(10), pytest.raises(FetchError, match="over the limit of 1000") as err:
            await a_content.fetch(root, tmp_path / "again.bin", use_dht=False, max_size=1000)
        assert err.value.refused


async def test_the_coordinators_fetch_of_the_validation_split_is_bounded_by_the_shards_bytes(tmp_path):
    """Issue 15 item 4: the validation CID is the submitter's choice; the coordinator fetches at most
    the training shards' bytes of it (JobTerms.validation_size_bound, IPIP-0003 §3)."""
    from dataclasses import replace

    from agent.node import Agent, AgentConfig
    from protocol.mirror import JobMirror
    from protocol import messages as m
    from protocol.identity import Identity
    from scripts.make_envelope_vectors import sample_terms

    too_big, fits = os.urandom(2 * MiB), os.urandom(MiB // 2)
    async with agents_with_content(2, tmp_path) as [(a, a_content), (b, b_content)]:
        coordinator = Agent(Identity.generate(), AgentConfig(home=tmp_path / "coordinator"))
        coordinator.content = b_content  # the coordinator's real content room; ``a`` is the submitter
        work = tmp_path / "coordinator" / "work" / "aggregate-r1"
        work.mkdir(parents=True)
        shards = tuple(m.ShardRef(i, "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4", 100, 400 << 10)
                       for i in range(2))
        for data, refused in ((too_big, True), (fits, False)):
            cid = await a_content.add_bytes(data, provide=False)
            terms = replace(sample_terms(Identity.generate()), submitter=a.peer_id, shards=shards,
                            validation_cid=str(cid))
            assert terms.validation_size_bound() == 800 << 10
            view = JobMirror(terms, 0.0, coordinator.peer_id)
            with trio.fail_after(30), pytest.raises(Exception) as err:
                await coordinator.coordinator._score(view, None, work / "adapter", work, with_base=False)
            path = work.parent / "validation.jsonl"
            if refused:  # stopped at its root: over the bound, nothing of it written
                assert isinstance(err.value, FetchError) and err.value.refused, err.value
                assert str(cid) in str(err.value) and f"limit of {800 << 10}" in str(err.value)
                assert not path.exists()
            else:  # within the bound it arrives whole (scoring it then needs a model this test has not)
                assert not isinstance(err.value, FetchError), err.value
                assert path.read_bytes() == data
