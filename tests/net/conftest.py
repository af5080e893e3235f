"""Helpers for network tests: real py-libp2p agents on loopback, in this test's trio run."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from agent.content.exchange import first_error
from agent.net.gossip import GossipConfig
from agent.net.host import NetConfig
from agent.net.stack import Network, open_network
from protocol.identity import Identity

pytestmark = pytest.mark.network


@asynccontextmanager
async def agents(count: int, *, gossip_config: GossipConfig = GossipConfig()) -> AsyncIterator[list[Network]]:
    """``count`` agents; the first is the bootstrap peer, the others know only its address.

    A failure inside comes out of py-libp2p's nested nurseries as a deep ExceptionGroup; it is
    re-raised here as the one exception that caused it, so test reports show it.
    """
    try:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(open_network(Identity.generate(), gossip_config=gossip_config))
            nets = [first]
            config = NetConfig(bootstrap=(first.host.addrs()[0],))
            for _ in range(count - 1):
                nets.append(await stack.enter_async_context(
                    open_network(Identity.generate(), config, gossip_config=gossip_config)))
            yield nets
    except BaseExceptionGroup as group:
        raise first_error(group) from None


async def wait_until(predicate: Callable[[], bool], *, timeout: float, poll: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; trio.TooSlowError after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(poll)


@asynccontextmanager
async def agents_with_content(count: int, data_root, *, idle_timeout: float = 5.0):
    """``agents(count)``, each with a content room whose blocks live under ``data_root/<i>``."""
    from agent.content.service import open_content

    async with agents(count) as nets, AsyncExitStack() as stack:
        rooms = [await stack.enter_async_context(
            open_content(net.host, net.discovery, data_root / f"agent{i}", idle_timeout=idle_timeout))
            for i, net in enumerate(nets)]
        yield list(zip(nets, rooms))
