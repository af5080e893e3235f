"""One agent's network: host, gossip and discovery, started and stopped together.

``open_network`` is the entry point the rest of the agent needs:

    async with open_network(identity, NetConfig(bootstrap=(...,))) as net:
        sub = await net.gossip.subscribe(TOPIC_JOBS)
        await net.discovery.advertise_worker()
        await net.gossip.publish(heartbeat)

Layers, outermost first: listeners and connections → Pubsub (GossipSub) → KadDHT → the task nursery.
Leaving the context unwinds them innermost first, so the agent's tasks end before the services
they use stop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from agent.net.discovery import Discovery
from agent.net.gossip import Gossip, GossipConfig
from agent.net.host import Host, NetConfig
from protocol.identity import Identity


@dataclass(frozen=True)
class Network:
    host: Host
    gossip: Gossip
    discovery: Discovery

    @property
    def peer_id(self) -> str:
        return self.host.peer_id


@asynccontextmanager
async def open_network(identity: Identity, config: NetConfig = NetConfig(),
                       gossip_config: GossipConfig = GossipConfig(), *,
                       clock: Callable[[], float] = time.time) -> AsyncIterator[Network]:
    host = Host(identity, config)
    gossip = Gossip(host, gossip_config, clock=clock)
    discovery = Discovery(host)
    async with host.run():
        await gossip.wait_ready()
        await discovery.bootstrap()
        host.nursery.start_soon(host.reach.maintain)  # AutoNAT; relay reservations while private
        yield Network(host, gossip, discovery)
