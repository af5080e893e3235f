"""Content by CID between real agents: add, provide, fetch, verify; bad and dying providers.

Every fetch here runs under a deadline; a hang fails the test instead of stalling it.
"""

import os
from pathlib import Path

import pytest
import trio

from agent.content.errors import FetchError
from agent.content.exchange import PROTOCOL, BlockServer
from agent.content import bitswap
from agent.content.service import VIA_BITSWAP, open_content
from agent.net.host import NetConfig
from agent.net.stack import open_network
from protocol.cid import varint_encode
from protocol.identity import Identity
from protocol.unixfs import MAX_BLOCK_SIZE, compute_cid, import_bytes
from tests.net.conftest import agents_with_content

pytestmark = pytest.mark.network

MiB = 1024 * 1024


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, bytes]:
    data = os.urandom(20 * MiB)
    path = tmp_path_factory.mktemp("data") / "dataset.bin"
    path.write_bytes(data)
    return path, data


async def test_a_20_mib_dataset_is_fetched_by_cid_byte_identical(tmp_path, dataset):
    source, data = dataset
    async with agents_with_content(3, tmp_path) as [_, (a, a_content), (b, b_content)]:
        root = await a_content.add_file(source)
        assert root == compute_cid(data)  # the CID `ipfs add --cid-version=1` prints
        out = tmp_path / "out" / "dataset.bin"
        with trio.fail_after(60):
            report = await b_content.fetch(root, out)  # providers found through the DHT
        assert out.read_bytes() == data
        assert report.providers_used == [a.peer_id] and report.size == len(data)
        assert leftovers(out.parent) == []
        # every block is now in b's store: a second fetch needs no provider
        with trio.fail_after(10):
            again = await b_content.fetch(root, tmp_path / "out" / "again.bin", use_dht=False)
        assert again.local_blocks == len(import_bytes(data)[1]) and again.fetched_blocks == 0


async def test_a_corrupted_block_is_rejected_with_its_cid_and_the_fetch_resumes_elsewhere(tmp_path):
    data = os.urandom(3 * MiB + 12345)
    root, blocks = import_bytes(data)
    bad = blocks[5]  # a leaf in the middle of the file
    async with agents_with_content(3, tmp_path) as [(a, a_content), (b, b_content), (c, c_content)]:
        assert await a_content.add_bytes(data) == root

        class LyingServer(BlockServer):
            """Serves one corrupted block, after its own hash check (on purpose)."""

            def _block_and_links(self, cid):
                block, children = super()._block_and_links(cid)
                return (block[:-1] + bytes([block[-1] ^ 1]) if cid == bad.cid else block), children

        LyingServer(a_content.store).install(a.host)
        out = tmp_path / "out.bin"
        with pytest.raises(FetchError) as failure, trio.fail_after(30):
            await b_content.fetch(root, out, providers=[a.peer_id], use_dht=False)
        assert str(bad.cid) in str(failure.value) and "does not match" in str(failure.value)
        assert failure.value.missing[0] == str(bad.cid)
        assert failure.value.corrupt == [a.peer_id] and not failure.value.invalid  # its sender's fault (issue 15)
        assert not out.exists() and leftovers(tmp_path) == []
        assert not b_content.store.has(bad.cid) and b_content.store.has(blocks[4].cid)

        # an honest provider appears: the fetch resumes from b's blocks and takes only the rest from c
        assert await c_content.add_bytes(data, provide=False) == root
        with trio.fail_after(30):
            report = await b_content.fetch(root, out, providers=[a.peer_id, c.peer_id], use_dht=False)
        assert out.read_bytes() == data
        assert report.local_blocks == 5 and report.providers_used == [c.peer_id]
        assert str(bad.cid) in report.attempts[0]
        assert report.corrupt == [a.peer_id]


async def killable_agent(bootstrap: str, data_dir: Path, kill: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED):
    """An agent in its own task; setting ``kill`` shuts its host down (connections close)."""
    async with open_network(Identity.generate(), NetConfig(bootstrap=(bootstrap,))) as net:
        async with open_content(net.host, net.discovery, data_dir, idle_timeout=5.0) as content:
            task_status.started((net, content))
            await kill.wait()


@pytest.mark.parametrize("second_provider", [True, False])
async def test_a_provider_killed_mid_transfer_means_another_provider_or_a_clean_error(tmp_path, dataset, second_provider):
    source, data = dataset
    async with agents_with_content(2, tmp_path) as [(boot, _), (b, b_content)]:
        async with trio.open_nursery() as nursery:
            kill = trio.Event()
            a, a_content = await nursery.start(killable_agent, boot.host.addrs()[0], tmp_path / "a", kill)
            root = await a_content.add_file(source, provide=False)
            walked = a_content.server.block

            def dies_after_20_blocks(cid):
                if a_content.server.blocks_served >= 20:
                    kill.set()  # the whole agent goes away, connections and all
                return walked(cid)

            a_content.server.block = dies_after_20_blocks
            providers = [a.host.addrs()[0]]
            if second_provider:
                c, c_content = await nursery.start(killable_agent, boot.host.addrs()[0], tmp_path / "c", trio.Event())
                await c_content.add_file(source, provide=False)
                providers.append(c.host.addrs()[0])
            out = tmp_path / "out.bin"
            with trio.fail_after(60):  # never a hang
                if second_provider:
                    report = await b_content.fetch(root, out, providers=providers, use_dht=False)
                    assert out.read_bytes() == data
                    assert report.providers_used == [a.peer_id, c.peer_id]
                else:
                    with pytest.raises(FetchError) as failure:
                        await b_content.fetch(root, out, providers=providers, use_dht=False)
                    assert str(root) in str(failure.value) and failure.value.missing
                    assert a.peer_id in str(failure.value)
                    assert not out.exists()
            assert kill.is_set()
            nursery.cancel_scope.cancel()


async def test_a_silent_provider_costs_one_idle_timeout(tmp_path):
    data = os.urandom(MiB)
    async with agents_with_content(2, tmp_path, idle_timeout=1.0) as [(a, a_content), (b, b_content)]:
        root = await a_content.add_bytes(data, provide=False)

        async def silent(stream):
            await trio.sleep_forever()

        a.host.set_handler(PROTOCOL, silent, timeout=None)
        with pytest.raises(FetchError) as failure, trio.fail_after(20):
            await b_content.fetch(root, tmp_path / "out.bin", providers=[a.peer_id], use_dht=False)
        assert "sent nothing for 1 s" in str(failure.value)


async def test_an_oversize_length_prefix_is_refused_before_reading(tmp_path):
    async with agents_with_content(2, tmp_path) as [(a, a_content), (b, b_content)]:
        root = await a_content.add_bytes(os.urandom(1000), provide=False)

        async def huge(stream):
            await stream.read(1024)
            await stream.write(varint_encode(MAX_BLOCK_SIZE + 2) + b"\0" * 1000)

        a.host.set_handler(PROTOCOL, huge, timeout=5)
        with pytest.raises(FetchError) as failure, trio.fail_after(20):
            await b_content.fetch(root, tmp_path / "out.bin", providers=[a.peer_id], use_dht=False)
        assert f"{MAX_BLOCK_SIZE + 1} byte block" in str(failure.value)


async def test_blocks_are_served_over_bitswap(tmp_path):
    data = os.urandom(2 * MiB + 1)
    async with agents_with_content(2, tmp_path) as [(a, a_content), (b, b_content)]:
        root = await a_content.add_bytes(data, provide=False)
        out = tmp_path / "out.bin"
        with trio.fail_after(60):
            report = await b_content.fetch(root, out, providers=[a.peer_id], use_dht=False, via=VIA_BITSWAP)
        assert out.read_bytes() == data and report.providers_used == [a.peer_id]


async def test_a_bitswap_fetch_after_the_inbound_streams_went_idle(tmp_path, monkeypatch):
    """Each side's inbound stream is reset after INBOUND_IDLE silent; the next fetch opens new ones."""
    monkeypatch.setattr(bitswap, "INBOUND_IDLE", 1.0)  # 60 s in the agent
    first, second = os.urandom(600_000), os.urandom(700_000)
    async with agents_with_content(2, tmp_path) as [(a, a_content), (b, b_content)]:
        roots = [await a_content.add_bytes(data, provide=False) for data in (first, second)]
        with trio.fail_after(30):
            await b_content.fetch(roots[0], tmp_path / "first.bin", providers=[a.peer_id], use_dht=False,
                                  via=VIA_BITSWAP)
        await trio.sleep(2)  # past the deadline: both inbound streams are reset
        with trio.fail_after(30):
            report = await b_content.fetch(roots[1], tmp_path / "second.bin", providers=[a.peer_id],
                                           use_dht=False, via=VIA_BITSWAP)
        assert (tmp_path / "second.bin").read_bytes() == second and report.providers_used == [a.peer_id]
