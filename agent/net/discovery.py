"""Discovery: a Kademlia DHT in server mode, reached from a bootstrap list.

Rules of this file:
- An agent knows the network only through ``NetConfig.bootstrap``. It dials those peers and puts
  them in its routing table; everything else it learns through the DHT.
- Agents that train provide a well-known namespace key, ``WORKERS_KEY``: the CIDv1 (raw) of
  ``b"infernet/v1/workers"``, so the DHT key is an ordinary sha2-256 multihash, as for content.
  Finding peers is finding the providers of that key; a new agent that knows only a bootstrap peer
  finds every training agent that way, without anyone listing it.
- Content roots are provided under their own CIDs (``provide``/``find_providers``).
- Provider lookups always ask the network. py-libp2p 0.8.1's ``find_providers`` answers from the
  local store alone as soon as that holds any record (ourselves included, once we provide the same
  key), which would hide every other provider; ``find_providers`` here merges the local records
  with an iterative network lookup.
- Every query runs under a deadline; a peer that does not answer costs one query timeout. Every
  inbound DHT stream runs under one too (``INBOUND_STREAM_TIMEOUT``).
- ``maintain`` (a task in the host's nursery) re-advertises and re-discovers periodically and dials
  newly found workers, so gossip meshes form among agents that never listed each other.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError

from agent.net.errors import NetError
from agent.net.host import Host
from protocol.cid import CID, RAW

log = logging.getLogger(__name__)
# py-libp2p's WARNING for every DHT stream its peer closes after a request (a normal EOF) is
# demoted to DEBUG by the log handler's filter: agent/net/lognoise.py

WORKERS_NAMESPACE = b"infernet/v1/workers"
WORKERS_KEY = CID.for_block(WORKERS_NAMESPACE, RAW)
QUERY_TIMEOUT = 5.0
INBOUND_STREAM_TIMEOUT = 30.0
ALPHA = 3
REPROVIDE_SECONDS = 600.0  # a CID provided and confirmed this recently is not provided again (``provide``)


def dht_key(cid: CID) -> bytes:
    """The DHT key of a CID: its multihash (what Kubo uses for provider records)."""
    return cid.multihash


class Discovery:
    """Kademlia DHT in server mode over ``host`` (register before ``host.run``)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.dht = KadDHT(host.libp2p, DHTMode.SERVER)
        host.add_service(self.dht)
        # py-libp2p serves at most 12 inbound DHT streams at once and puts no deadline on them, so
        # a few silent streams would shut our DHT to everyone: each one gets a deadline
        host.set_handler(KAD_PROTOCOL_ID, self.dht.handle_stream, timeout=INBOUND_STREAM_TIMEOUT)
        self._provided: dict[bytes, float] = {}  # key -> when a DHT server last confirmed our record of it

    async def bootstrap(self, *, timeout: float | None = None) -> list[str]:
        """Dial every bootstrap peer (concurrently, each under a deadline); return those reached."""
        reached: list[str] = []

        async def dial(index: int, info: PeerInfo) -> None:
            try:
                await self.host.connect(info, timeout=timeout)
            except NetError as exc:
                log.warning("bootstrap[%d]: %s", index, exc)
                return
            await self.dht.add_peer(info.peer_id, skip_server_mode_check=True)
            reached.append(info.peer_id.to_base58())

        async with trio.open_nursery() as nursery:
            for i, info in enumerate(self.host.bootstrap_peers):
                nursery.start_soon(dial, i, info)
        return reached

    async def provide(self, cid: CID, *, timeout: float = 30.0, again: bool = False) -> bool:
        """Announce that we provide ``cid``; True if at least one other DHT server stored it. A key a DHT server
        confirmed less than REPROVIDE_SECONDS ago is not provided again (True at once) unless ``again``: a
        worker fetched its shard, and provided it, every round (a lookup and a store RPC to each of the key's
        closest peers, for a record that lives 48 h); a DHT's own republish interval is 22 h."""
        key = dht_key(cid)
        now = trio.current_time()
        if not again and now - self._provided.get(key, -math.inf) < REPROVIDE_SECONDS:
            return True
        with trio.move_on_after(timeout):
            stored = await self.dht.provider_store.provide(key)
            if stored:
                if len(self._provided) >= 10_000:
                    self._provided = {k: t for k, t in self._provided.items() if now - t < REPROVIDE_SECONDS}
                self._provided[key] = trio.current_time()
            return stored
        log.warning("provide %s: no DHT server confirmed within %.0f s", cid, timeout)
        return False

    async def advertise_worker(self, *, timeout: float = 30.0) -> bool:
        """Announce that this agent trains (provider of WORKERS_KEY), every time: it is how peers find us."""
        return await self.provide(WORKERS_KEY, timeout=timeout, again=True)

    async def find_providers(self, cid: CID, *, count: int = 20, timeout: float = 15.0) -> list[PeerInfo]:
        """Providers of ``cid`` other than us: local records plus an iterative network lookup."""
        key = dht_key(cid)
        me = self.host.libp2p.get_id()
        found: dict[ID, PeerInfo] = {}

        def add(infos: list[PeerInfo]) -> None:
            for info in infos:
                if info.peer_id != me and info.peer_id not in found:
                    found[info.peer_id] = info

        add(self.dht.provider_store.get_providers(key))
        with trio.move_on_after(timeout):
            await self._lookup(key, count, add, found)
        return list(found.values())[:count]

    async def _lookup(self, key: bytes, count: int, add: Any, found: dict) -> None:
        store = self.dht.provider_store
        me = self.host.libp2p.get_id()
        candidates = list(await self.dht.peer_routing.find_closest_peers_network(key))
        queried: set[ID] = set()
        while candidates and len(found) < count:
            batch, candidates = candidates[:ALPHA], candidates[ALPHA:]
            closer: list[ID] = []

            async def ask(peer: ID) -> None:
                queried.add(peer)
                with trio.move_on_after(QUERY_TIMEOUT):
                    # private in py-libp2p 0.8.1, but the only call that asks one peer (see rules)
                    providers, closer_peers = await store._get_providers_from_peer_with_closers(peer, key)
                    for info in providers:
                        store.add_provider(key, info)
                    add(providers)
                    closer.extend(closer_peers)

            async with trio.open_nursery() as nursery:
                for peer in batch:
                    if peer != me and peer not in queried:
                        nursery.start_soon(ask, peer)
            fresh = {p for p in closer if p not in queried and p != me and p not in candidates}
            if fresh:
                candidates = sort_peer_ids_by_distance(key, candidates + list(fresh))

    async def find_peer(self, peer: str, *, timeout: float = QUERY_TIMEOUT) -> PeerInfo | None:
        """Addresses of ``peer``: from the peerstore if known, else a DHT lookup (None if not found)."""
        peer_id = ID.from_base58(peer)
        try:
            addrs = self.host.libp2p.get_peerstore().addrs(peer_id)
        except PeerStoreError:  # py-libp2p raises for a peer it has never heard of
            addrs = []
        if addrs:
            return PeerInfo(peer_id, addrs)
        with trio.move_on_after(timeout):
            return await self.dht.find_peer(peer_id)
        return None

    async def find_workers(self, *, count: int = 50, timeout: float = 15.0, connect: bool = True) -> list[str]:
        """Peer IDs of training agents found through the DHT; dial them unless ``connect=False``."""
        infos = await self.find_providers(WORKERS_KEY, count=count, timeout=timeout)
        if connect:
            async with trio.open_nursery() as nursery:
                for info in infos:
                    nursery.start_soon(self._dial_quietly, info)
        return [info.peer_id.to_base58() for info in infos]

    async def _dial_quietly(self, info: PeerInfo) -> None:
        if not info.addrs:
            return
        try:
            await self.host.connect(info, timeout=QUERY_TIMEOUT)
        except NetError as exc:
            log.debug("discovery: %s", exc)

    async def maintain(self, *, advertise: bool, interval: float = 30.0) -> None:
        """Forever: dial again the bootstrap peers we lost, re-advertise (if ``advertise``) and re-discover
        workers every ``interval`` s."""
        while True:
            try:
                await self.redial_bootstrap(timeout=min(interval, 10.0))
                if advertise:
                    await self.advertise_worker()
                await self.find_workers()
            except Exception as exc:  # noqa: BLE001 - a failed round must not end discovery
                log.warning("discovery round failed: %r", exc)
            await trio.sleep(interval)

    async def redial_bootstrap(self, *, timeout: float = 10.0) -> list[str]:
        """Dial the bootstrap peers we are not connected to; return those reached. A bootstrap peer that
        restarted (a submitter after kill -9, often every other peer's bootstrap) has no bootstrap list
        of its own and heard nobody until someone dialled it: the soak found a restarted submitter
        alone for 60 s, its job failed meanwhile (issue 21 §5)."""
        connected = set(self.host.connected_peers())
        lost = [info for info in self.host.bootstrap_peers if info.peer_id.to_base58() not in connected]
        reached: list[str] = []

        async def dial(info: PeerInfo) -> None:
            try:
                await self.host.connect(info, timeout=timeout)
            except NetError as exc:
                log.debug("bootstrap peer %s not reached again: %s", info.peer_id.to_base58()[-8:], exc)
                return
            await self.dht.add_peer(info.peer_id, skip_server_mode_check=True)
            reached.append(info.peer_id.to_base58())
            log.info("bootstrap peer %s reached again", info.peer_id.to_base58()[-8:])

        async with trio.open_nursery() as nursery:
            for info in lost:
                nursery.start_soon(dial, info)
        return reached
