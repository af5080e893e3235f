"""Helpers for network tests: real py-libp2p agents on loopback, in this test's trio run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from agent.net.gossip import GossipConfig
from agent.net.host import NetConfig
from agent.net.network import Network, open_network
from protocol.identity import Identity

pytestmark = pytest.mark.network


@asynccontextmanager
async def agents(count: int, *, gossip_config: GossipConfig = GossipConfig()) -> AsyncIterator[list[Network]]:
    """``count`` agents; the first is the bootstrap peer, the others know only its address."""
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(open_network(Identity.generate(), gossip_config=gossip_config))
        nets = [first]
        config = NetConfig(bootstrap=(first.host.addrs()[0],))
        for _ in range(count - 1):
            nets.append(await stack.enter_async_context(
                open_network(Identity.generate(), config, gossip_config=gossip_config)))
        yield nets


async def wait_until(predicate: Callable[[], bool], *, timeout: float, poll: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; trio.TooSlowError after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(poll)
