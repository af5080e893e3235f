"""Which protocol a fetch speaks to each provider, and fetches that must end by their deadline.

- A default fetch uses /infernet/blocks/1.0.0 with a provider that offers it and Bitswap with one
  that does not (a plain IPFS node), within one fetch, keeping its deadline and size bounds.
- A content room that stopped leaves no Bitswap stream behind that would swallow the blocks of a
  later room's fetch on the same host (scripts/bench_net.py stalled on that for minutes).
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from agent.content.bitswap import BitswapExchange
from agent.content.blockstore import BlockStore
from agent.content.errors import FetchError
from agent.content.service import VIA_AUTO, VIA_BITSWAP, VIA_BLOCKS, open_content
from protocol.unixfs import import_bytes
from tests.net.conftest import agents

pytestmark = pytest.mark.network


async def test_a_bitswap_fetch_by_a_new_content_room_on_the_same_host_completes(tmp_path):
    """The first room's Bitswap client is stopped; its inbound stream from the provider must not
    keep receiving the blocks the second room asked for (they went to the first room's store, and
    the second fetch waited out every window)."""
    first, second = os.urandom(300_000), os.urandom(400_000)
    async with agents(2) as [a, b]:
        async with open_content(a.host, a.discovery, tmp_path / "a", idle_timeout=20) as a_content:
            roots = [await a_content.add_bytes(data, provide=False) for data in (first, second)]
            async with open_content(b.host, b.discovery, tmp_path / "b1", idle_timeout=20) as b_content:
                with trio.fail_after(10):
                    await b_content.fetch(roots[0], tmp_path / "first.bin", providers=[a.peer_id],
                                          use_dht=False, via=VIA_BITSWAP)
            async with open_content(b.host, b.discovery, tmp_path / "b2", idle_timeout=20) as b_content:
                # ends by its own deadline (FetchError) if the blocks go astray: 10 s < idle_timeout
                report = await b_content.fetch(roots[1], tmp_path / "second.bin", providers=[a.peer_id],
                                               use_dht=False, via=VIA_BITSWAP, timeout=10)
        assert (tmp_path / "second.bin").read_bytes() == second and report.providers_used == [a.peer_id]


@asynccontextmanager
async def bitswap_only(net, root_dir) -> AsyncIterator[BlockStore]:
    """A peer like a plain IPFS node: it serves its blockstore over Bitswap and has no
    /infernet/blocks/1.0.0 handler, so it answers "na" when that protocol is asked for."""
    store = BlockStore(root_dir)
    exchange = BitswapExchange(net.host, store)
    await exchange.start()
    try:
        yield store
    finally:
        await exchange.stop()


def add_to(store: BlockStore, data: bytes):
    root, blocks = import_bytes(data)
    for block in blocks:
        store.put(block.cid, block.data)
    return root


async def test_a_default_fetch_asks_a_bitswap_only_provider_over_bitswap(tmp_path):
    first, second = os.urandom(700_000), os.urandom(300_000)
    async with agents(3) as [ipfs_like, agent, fetcher], bitswap_only(ipfs_like, tmp_path / "ipfs") as store, \
            open_content(agent.host, agent.discovery, tmp_path / "agent", idle_timeout=5) as agent_content, \
            open_content(fetcher.host, fetcher.discovery, tmp_path / "fetcher", idle_timeout=5) as content:
        roots = [add_to(store, data) for data in (first, second)]
        with trio.fail_after(20):
            report = await content.fetch(roots[0], tmp_path / "first.bin", providers=[ipfs_like.peer_id],
                                         use_dht=False)
        assert (tmp_path / "first.bin").read_bytes() == first
        assert report.protocols == {ipfs_like.peer_id: VIA_BITSWAP} and report.attempts == []
        # remembered: the next fetch from it asks over Bitswap at once (no refused negotiation)
        assert content._protocol_for(ipfs_like.peer_id, VIA_AUTO) == VIA_BITSWAP
        with trio.fail_after(20):
            report = await content.fetch(roots[1], tmp_path / "second.bin", providers=[ipfs_like.peer_id],
                                         use_dht=False)
        assert (tmp_path / "second.bin").read_bytes() == second and report.protocols == {ipfs_like.peer_id: VIA_BITSWAP}
        # an agent is still asked over our block protocol
        ours = await agent_content.add_bytes(os.urandom(400_000), provide=False)
        with trio.fail_after(20):
            report = await content.fetch(ours, tmp_path / "ours.bin", providers=[agent.peer_id], use_dht=False)
        assert report.protocols == {agent.peer_id: VIA_BLOCKS}
        # forced to our protocol, the same plain node is refused: one attempt naming the protocol
        with pytest.raises(FetchError) as failure:
            await content.fetch(add_to(store, os.urandom(1000)), tmp_path / "forced.bin",
                                providers=[ipfs_like.peer_id], use_dht=False,
                                via=VIA_BLOCKS, timeout=20)
        assert "does not support /infernet/blocks/1.0.0" in str(failure.value)


async def test_a_fetch_falling_back_to_bitswap_keeps_its_size_bound_and_its_deadline(tmp_path):
    data = os.urandom(600_000)
    async with agents(2) as [ipfs_like, fetcher], bitswap_only(ipfs_like, tmp_path / "ipfs") as store, \
            open_content(fetcher.host, fetcher.discovery, tmp_path / "fetcher", idle_timeout=30) as content:
        root = add_to(store, data)
        # the size bound: the root states 600,000 bytes, the bound is 500,000: refused at the root
        with pytest.raises(FetchError) as failure:
            await content.fetch(root, tmp_path / "big.bin", providers=[ipfs_like.peer_id], use_dht=False,
                                max_size=500_000, timeout=20)
        assert failure.value.refused and "500000" in str(failure.value).replace(",", "")
        assert not (tmp_path / "big.bin").exists()
        # the deadline: a CID the node does not have ends by the fetch's own timeout (2 s), long
        # before the provider's idle timeout (30 s)
        missing, _ = import_bytes(os.urandom(1000))
        started = trio.current_time()
        with pytest.raises(FetchError) as failure:
            await content.fetch(missing, tmp_path / "missing.bin", providers=[ipfs_like.peer_id], use_dht=False,
                                timeout=2)
        assert "not complete within 2 s" in str(failure.value) and trio.current_time() - started < 10
