"""Which protocol a fetch speaks to each provider, and fetches that must end by their deadline.

- A default fetch uses /infernet/blocks/1.0.0 with a provider that offers it and Bitswap with one
  that does not (a plain IPFS node), within one fetch, keeping its deadline and size bounds.
- A content room that stopped leaves no Bitswap stream behind that would swallow the blocks of a
  later room's fetch on the same host (scripts/bench_net.py stalled on that for minutes).
"""

import os

import pytest
import trio

from agent.content.service import VIA_BITSWAP, open_content
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
