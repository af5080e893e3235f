"""Content by CID: add files to the blockstore and provide them; fetch files from providers.

Rules of this file:
- ``add_file`` chunks a file with protocol/unixfs (CIDv1, raw leaves: the CID ``ipfs add
  --cid-version=1`` prints), stores every block, and provides the root in the DHT. With an IPFS
  daemon configured, the file is also added there, and the daemon's CID must equal ours.
- ``fetch`` produces ``out_path`` only when the whole DAG has arrived and been verified; until then
  the bytes go to a temp file next to it, renamed into place at the end (never a half-written file).
  Order of sources: blocks already in the local store (so an interrupted fetch resumes where it was),
  then each provider in turn (explicit ones first, then the DHT's) over a direct connection, then
  (IPIP-0003 §4.1) the providers reachable only through a relay, dialled through it last and skipped
  (no circuit opened) when the file's known size exceeds a circuit's byte limit (``relay_data_limit``:
  the relay's ``RELAY_LIMITS.data``), then the IPFS daemon if one is configured. Every block passes one ``StreamVerifier`` whatever
  its source; a provider that dies, stalls, or sends a bad block is left, and the next continues from
  the same position.
- Every fetch is bounded (IPIP-0003 "Size bounds"): ``max_size`` (the most the caller's protocol
  allows for that object) or ``exact_size`` (a shard: ``ShardRef.size``), and the service's
  ``max_file_size``. The verified root block states the file's size; a root over the bound ends
  the fetch at once with FetchError naming the CID and the bound, before any other block is
  asked for (no provider can do better: the size is the CID's), and the bytes arriving are
  counted against the stated size.
- The protocol is chosen per provider (``via="auto"``, the default; IPIP-0003 §4): our
  /infernet/blocks/1.0.0 first; a provider that refuses it in protocol negotiation (a plain IPFS
  node: Kubo, Helia) is asked over Bitswap in the same fetch, from the same verifier position, and
  is remembered for ``NO_BLOCKS_TTL`` seconds so the next fetch goes straight to Bitswap. Only a
  refusal falls back: a provider that fails any other way (silent, broken stream, bad block) is left
  as before. ``via="blocks"`` or ``"bitswap"`` forces one protocol for every provider.
- A swarm (``swarm``: the peers fetching the same file at the same time, ours among them, in one order all
  of them know; IPIP-0003 §4.2): before the rules above, the root alone is asked of the first provider (the
  seed; a shallow request over /infernet/blocks/1.1.0: a seed without it means no swarm), its subtrees are
  dealt out to the members in turn, each member takes its own from the
  seed in one request, and the others from the member they were dealt to, as that member receives them
  (over /infernet/blocks/1.1.0, the member waits up to ``SWARM_WAIT`` for each block it lacks yet, so the
  blocks flow on one stream; one without it is asked again every ``SWARM_POLL``). So the seed's uplink carries
  the file about once, not once per member. Every block is hash-checked against the verified root's
  links as in any fetch. A member that fails, or stands still for ``SWARM_STALL`` (or as long as our own
  part took, if longer) once our own part is in, is left; whatever the swarm did not bring, the plain fetch above takes from the providers, from the
  seed first.
- Every wait has a deadline: the whole fetch (``timeout``), each provider lookup, each stream read.
  A fetch that cannot complete raises FetchError naming the root, the first missing block and why
  each provider failed.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.peerinfo import PeerInfo

from agent.content.bitswap import BitswapExchange
from agent.content.blockstore import BlockStore
from agent.content.errors import ContentError, FetchError
from agent.content.exchange import BlockServer, fetch_block, fetch_from_peer
from agent.content.ipfs_daemon import IpfsDaemon
from agent.net.discovery import Discovery
from agent.net.errors import NetConfigError, NetError, ProtocolNotSupported
from agent.net.host import Host, parse_peer_multiaddr, to_libp2p_id
from agent.net.reach import RELAY_LIMITS
from protocol.cid import CID, RAW, parse_cid
from protocol.errors import CIDError, FileSizeError, KeyFileError
from protocol.identity import public_key_from_peer_id
from protocol.unixfs import Block, StreamVerifier, deal, import_file

log = logging.getLogger(__name__)

VIA_AUTO = "auto"  # per provider: ours where it is offered, else Bitswap
VIA_BLOCKS = "blocks"
VIA_BITSWAP = "bitswap"
SYNC_EVERY = 8 << 20  # a fetch's output file is flushed to disk every this many bytes, as they arrive
NO_BLOCKS_TTL = 600.0  # how long a provider that refused /infernet/blocks is asked over Bitswap directly
SWARM_WAIT = 2.0  # seconds a swarm member waits for each block of its part it lacks yet (/infernet/blocks/1.1.0)
SWARM_POLL = 0.1  # seconds between asks to a member without 1.1.0 that lacks the next block of its part yet
SWARM_STALL = 1.0  # a swarm member's part may stand still this long (at least) once our own part is in


@dataclass
class SwarmReport:
    """What a swarm fetch's first phase did (IPIP-0003 §4.2)."""

    members: int = 0
    parts: int = 0  # the root's subtrees, dealt out to the members in turn
    from_seed: int = 0  # blocks from the seed: the root and our own parts
    from_members: dict[str, int] = field(default_factory=dict)  # member -> blocks of its parts it sent us
    left: list[str] = field(default_factory=list)  # why a member (or the seed) was left


@dataclass
class FetchReport:
    """What a completed fetch did: where the blocks came from."""

    cid: CID
    path: Path
    size: int
    local_blocks: int = 0
    fetched_blocks: int = 0
    providers_used: list[str] = field(default_factory=list)
    protocols: dict[str, str] = field(default_factory=dict)  # provider -> VIA_BLOCKS or VIA_BITSWAP spoken
    attempts: list[str] = field(default_factory=list)
    refused: str = ""  # why the file itself is refused (its root states a size over the bound)
    corrupt: list[str] = field(default_factory=list)  # providers that sent a block failing verification
    relay_skipped: list[str] = field(default_factory=list)  # reachable only through a relay; file too large
    direct_failed: dict[str, str] = field(default_factory=dict)  # provider -> why its direct dial failed
    unreached: list[str] = field(default_factory=list)  # providers no dial reached (directly nor relayed)
    swarm: SwarmReport | None = None  # the swarm phase, if one ran (its blocks count as fetched, not local)


class ContentService:
    """The agent's content room over a running ``host`` and ``discovery``."""

    def __init__(self, host: Host, discovery: Discovery, store: BlockStore, *,
                 ipfs: IpfsDaemon | None = None, idle_timeout: float = 30.0,
                 max_file_size: int | None = None) -> None:
        self.host = host
        self.discovery = discovery
        self.store = store
        self.ipfs = ipfs
        self.idle_timeout = idle_timeout
        self.max_file_size = max_file_size
        self.server = BlockServer(store, idle_timeout=idle_timeout)
        self.server.install(host)
        self.bitswap = BitswapExchange(host, store)
        self._no_blocks: dict[str, float] = {}  # provider -> trio time it refused /infernet/blocks
        # a circuit carries at most this many bytes (every agent's relay serves RELAY_LIMITS)
        self.relay_data_limit = RELAY_LIMITS.data

    async def start(self) -> None:
        """Start serving over Bitswap (needs the running host's nursery)."""
        await self.bitswap.start()

    async def stop(self) -> None:
        await self.bitswap.stop()

    # -- adding -----------------------------------------------------------------------------------

    async def add_file(self, path: str | os.PathLike[str], *, provide: bool = True) -> CID:
        """Chunk, store and (by default) provide a file; return its root CID."""
        path = Path(path)
        if not path.is_file():
            raise ContentError(f"add {path}: not a readable file")

        def import_in_thread() -> CID:
            with open(path, "rb") as fh:
                # our own import's blocks are correct by construction: no second hash
                return import_file(fh, cid_version=1, on_block=self._store_own_block)

        root = await trio.to_thread.run_sync(import_in_thread)
        if self.ipfs is not None:
            await self.ipfs.add_file(path, expected=root)
        if provide:
            await self.discovery.provide(root)
        return root

    async def add_bytes(self, data: bytes, *, provide: bool = True) -> CID:
        root = await trio.to_thread.run_sync(
            lambda: import_file(io.BytesIO(data), cid_version=1, on_block=self._store_own_block))
        if provide:
            await self.discovery.provide(root)
        return root

    def _store_own_block(self, block: Block) -> None:
        self.store.put_verified(block.cid, block.data)

    # -- fetching ---------------------------------------------------------------------------------

    async def fetch(self, cid: CID | str, out_path: str | os.PathLike[str], *, timeout: float = 600.0,
                    providers: Sequence[str] = (), via: str = VIA_AUTO, use_dht: bool = True,
                    max_size: int | None = None, exact_size: int | None = None,
                    swarm: Sequence[str] = ()) -> FetchReport:
        """Fetch the file ``cid`` into ``out_path`` (see the rules above).

        ``providers`` are peer IDs or /p2p/ multiaddrs to try before the DHT's providers.
        ``swarm``: the peer IDs fetching this file now, ours among them, in the order every one of them
        uses; the first provider is their seed (see the rules above). Ignored without providers.
        ``max_size``/``exact_size`` bound the file (FetchError at the root if it states more/other).
        ``via``: "auto" (per provider, see the rules above), "blocks" or "bitswap" (that one only).
        """
        root = parse_cid(cid) if isinstance(cid, str) else cid
        if via not in (VIA_AUTO, VIA_BLOCKS, VIA_BITSWAP):
            raise ValueError(f"via must be {VIA_AUTO!r}, {VIA_BLOCKS!r} or {VIA_BITSWAP!r}")
        sources = _parse_providers(providers)
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(f".{out_path.name}.part{os.getpid()}")
        bounds = [b for b in (max_size, self.max_file_size) if b is not None]
        verifier = StreamVerifier(root, max_file_size=min(bounds) if bounds else None, exact_size=exact_size)
        report = FetchReport(root, out_path, 0)
        try:
            with open(tmp, "wb") as out:
                unsynced = 0

                def on_block(block_cid: CID, data: bytes, payload: bytes) -> None:
                    nonlocal unsynced
                    self.store.put_verified(block_cid, data)
                    out.write(payload)
                    report.size += len(payload)
                    report.fetched_blocks += 1
                    # flush as we go (this runs in a worker thread, while the network goes on), so
                    # the final fsync has at most SYNC_EVERY bytes left to write
                    unsynced += len(payload)
                    if unsynced >= SYNC_EVERY:
                        out.flush()
                        os.fdatasync(out.fileno())
                        unsynced = 0

                with trio.move_on_after(timeout) as deadline:
                    swarmed = 0
                    if len(swarm) > 1 and sources and self.host.peer_id in swarm:
                        report.swarm = SwarmReport(members=len(swarm))
                        await self._swarm(root, sources[0], list(swarm), report.swarm,
                                          StreamVerifier(root, max_file_size=verifier.max_file_size,
                                                         exact_size=exact_size))
                        swarmed = report.swarm.from_seed + sum(report.swarm.from_members.values())
                        report.providers_used += ([sources[0][0]] if report.swarm.from_seed else []) + \
                            [peer for peer, blocks in report.swarm.from_members.items() if blocks]
                    # in a thread: resuming a large file re-hashes every block it already has
                    await trio.to_thread.run_sync(self._resume_from_store, verifier, out, report)
                    moved = min(swarmed, report.local_blocks)  # the swarm's blocks were fetched, not held
                    report.local_blocks -= moved
                    report.fetched_blocks += moved
                    if not verifier.done:
                        await self._fetch_remote(verifier, on_block, report, sources, via, use_dht)
                if oversize := report.refused:
                    raise FetchError(str(root), oversize, attempts=report.attempts, refused=True)
                if not verifier.done:
                    reason = (f"not complete within {timeout:.0f} s" if deadline.cancelled_caught
                              else "no source could supply the rest")
                    # the relay-only reason only when no provider was reached and asked: else the
                    # attempts (lacking blocks, corrupt ones, ...) say why
                    relay_only = len(report.relay_skipped) + len(report.unreached) == len(report.attempts)
                    if report.relay_skipped and relay_only and not report.fetched_blocks:
                        size = verifier.exact_size if verifier.exact_size is not None else verifier.file_size
                        reason = (f"{len(report.relay_skipped)} provider(s) reachable only through a relay, whose "
                                  f"circuits carry at most {self.relay_data_limit} bytes; this file is {size}, "
                                  f"and no provider could be reached directly")
                    raise FetchError(str(root), reason, missing=[str(c) for c in verifier.remaining()],
                                     attempts=report.attempts, corrupt=report.corrupt)
                out.flush()
                # not in the event loop: flushing the tail of a large file can take a while
                await trio.to_thread.run_sync(os.fsync, out.fileno())
            os.replace(tmp, out_path)
            return report
        finally:
            tmp.unlink(missing_ok=True)

    async def _swarm(self, root: CID, seed_source: tuple[str, PeerInfo | None], members: list[str],
                     report: SwarmReport, probe: StreamVerifier) -> None:
        """The swarm phase (IPIP-0003 §4.2; the rules above): blocks into the store, nothing written out.
        Returns early, leaving everything to the plain fetch, when the root cannot be had or is refused."""
        seed, info = seed_source
        if seed == self.host.peer_id:
            return
        began = trio.current_time()
        try:
            await self._reach(seed, info, relay=False)
            block = self.store.get(root)
            if block is None:
                block = await fetch_block(self.host, seed, root, idle_timeout=self.idle_timeout)
                report.from_seed += 1
            probe.feed(block)  # hash, structure and the size bounds: a refused root is the plain fetch's to report
            self.store.put_verified(root, block)
        except (NetError, CIDError, FileSizeError) as exc:
            report.left.append(f"seed {seed}: root: {exc}")
            return
        parts = probe.parts()
        report.parts = len(parts)
        count = len(members)
        index = members.index(self.host.peer_id)
        # dealt over all the root's parts (every member deals alike); leaves we hold already are not asked for

        def needed(part: tuple[CID, int | None, int]) -> bool:
            return not (part[0].codec == RAW and self.store.has(part[0]))

        dealt = {member: [parts[j] for j in indices if needed(parts[j])]
                 for member, indices in deal(len(parts), members).items()}
        mine = dealt[self.host.peer_id]
        # When a member that has sent nothing lately is left: once a reference moment has passed (our own
        # part in from the seed; with no part of our own, the root in), it gets as long again as that moment
        # took, at least SWARM_STALL, to send its next block.
        rooted = trio.current_time()
        token = trio.lowlevel.current_trio_token()
        reference = trio.Event()
        reference_at = [0.0]

        def mark_reference() -> None:
            if not reference.is_set():
                reference_at[0] = trio.current_time()
                reference.set()

        async def own() -> None:
            def counted(cid: CID, data: bytes, _payload: bytes) -> None:
                self.store.put_verified(cid, data)
                report.from_seed += 1

            try:
                await fetch_from_peer(self.host, seed, StreamVerifier.for_parts(root, mine), counted,
                                      idle_timeout=self.idle_timeout)
            except (NetError, CIDError) as exc:
                report.left.append(f"seed {seed}: {exc}")
            finally:
                mark_reference()

        async def member(peer: str, part: list[tuple[CID, int | None, int]]) -> None:
            verifier = StreamVerifier.for_parts(root, part)
            moved = began

            def note_moved() -> None:
                nonlocal moved
                moved = trio.current_time()

            def counted(cid: CID, data: bytes, _payload: bytes) -> None:  # in the fetch's checker thread
                self.store.put_verified(cid, data)
                report.from_members[peer] = report.from_members.get(peer, 0) + 1
                token.run_sync_soon(note_moved)

            async def pull() -> None:
                try:
                    await self._reach(peer, None, relay=False)  # bulk bytes never go through a relay
                except NetError as exc:
                    report.left.append(f"member {peer}: {exc}")
                    return
                wait = min(SWARM_WAIT, self.idle_timeout / 2)  # the server's wait within our read deadline
                while not verifier.done:
                    try:
                        if await fetch_from_peer(self.host, peer, verifier, counted, idle_timeout=self.idle_timeout,
                                                 wait=wait):
                            return
                    except ProtocolNotSupported as exc:
                        if wait:  # an agent without /infernet/blocks/1.1.0: asked every SWARM_POLL instead
                            wait = 0.0
                            continue
                        report.left.append(f"member {peer}: {exc}")
                        return
                    except (NetError, CIDError) as exc:
                        report.left.append(f"member {peer}: {exc}")
                        return
                    if not wait:
                        await trio.sleep(SWARM_POLL)

            async def watch(scope: trio.CancelScope) -> None:
                """The stall rule, whatever the member is doing (dialling, or a request it does not answer)."""
                await reference.wait()
                stall = max(SWARM_STALL, reference_at[0] - began)
                while (due := max(moved, reference_at[0]) + stall) > trio.current_time():
                    await trio.sleep_until(due)
                report.left.append(f"member {peer}: lacked block {verifier.expected()} for {stall:.1f} s")
                scope.cancel()

            async with trio.open_nursery() as inner:
                inner.start_soon(watch, inner.cancel_scope)
                await pull()
                inner.cancel_scope.cancel()  # done (or left): the watch ends

        if not mine:
            mark_reference()
        async with trio.open_nursery() as nursery:
            if mine:
                nursery.start_soon(own)
            for k, peer in enumerate(members):
                if k != index and dealt[peer]:
                    nursery.start_soon(member, peer, dealt[peer])
        log.info("fetch %s: swarm of %d: %d parts; %d blocks from the seed, %s from members; the root in at %.2f s, "
                 "our parts at %s, all at %.2f s%s", root, count, len(parts), report.from_seed,
                 dict(report.from_members) or "none", rooted - began,
                 f"{reference_at[0] - began:.2f} s" if mine else "-", trio.current_time() - began,
                 f"; left: {'; '.join(report.left)}" if report.left else "")

    async def read_local(self, cid: CID | str, out_path: str | os.PathLike[str], *,
                         max_size: int | None = None) -> bool:
        """Write the file ``cid`` to ``out_path`` from the blocks held here alone, each checked as a fetch checks
        it; False, with nothing written, when a block is missing (or the file is over ``max_size``)."""
        root = parse_cid(cid) if isinstance(cid, str) else cid
        if self.store.get(root) is None:
            return False
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(f".{out_path.name}.local{os.getpid()}")
        verifier = StreamVerifier(root, max_file_size=max_size)
        report = FetchReport(root, out_path, 0)

        def read() -> bool:
            with open(tmp, "wb") as out:
                self._resume_from_store(verifier, out, report)
            return verifier.done and not report.refused

        try:
            if not await trio.to_thread.run_sync(read):
                return False
            os.replace(tmp, out_path)
            return True
        except FetchError:  # a held root naming a bad DAG: not a file we hold
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _resume_from_store(self, verifier: StreamVerifier, out: Any, report: FetchReport) -> None:
        while (cid := verifier.expected()) is not None:
            data = self.store.get(cid)
            if data is None:
                return
            try:
                payload = verifier.feed(data)
            except FileSizeError as exc:
                report.refused = str(exc)
                return
            except CIDError as exc:  # hash-valid block, invalid DAG: the root names a bad file
                raise FetchError(str(verifier.root), str(exc), invalid=True) from None
            out.write(payload)
            report.size += len(payload)
            report.local_blocks += 1

    async def _fetch_remote(self, verifier: StreamVerifier, on_block: Any, report: FetchReport,
                            providers: list[tuple[str, PeerInfo | None]], via: str, use_dht: bool) -> None:
        """Named providers, then the DHT's, each dialled directly; then, last, those reachable only
        through a relay (IPIP-0003 §4.1), each skipped when the file is over a circuit's byte limit."""
        tried = {self.host.peer_id}
        late: list[tuple[str, PeerInfo | None]] = []  # reached only through a relay: asked last
        for peer, info in providers:
            if verifier.done or report.refused:
                return
            if not await self._try_provider(peer, info, verifier, on_block, report, via, tried, relay=False):
                late.append((peer, info))
        if use_dht and not verifier.done and not report.refused:
            for info in await self.discovery.find_providers(verifier.root, timeout=self.idle_timeout):
                if verifier.done or report.refused:
                    return
                peer = info.peer_id.to_base58()
                if not await self._try_provider(peer, info, verifier, on_block, report, via, tried, relay=False):
                    late.append((peer, info))
        for peer, info in late:
            if verifier.done or report.refused:
                return
            await self._try_provider(peer, info, verifier, on_block, report, via, tried, relay=True)
        if not verifier.done and not report.refused and self.ipfs is not None:
            try:
                await self.ipfs.fetch_blocks(verifier, on_block)
                report.providers_used.append("ipfs-daemon")
            except FileSizeError as exc:
                report.refused = str(exc)
            except ContentError as exc:
                report.attempts.append(f"ipfs daemon: {exc}")

    async def _try_provider(self, peer: str, info: PeerInfo | None, verifier: StreamVerifier, on_block: Any,
                            report: FetchReport, via: str, tried: set[str], *, relay: bool = True) -> bool:
        """Take as many blocks from ``peer`` as it will give; record why it stopped if incomplete.

        ``relay=False``: only over a direct connection; False (nothing tried, ask again with
        ``relay=True`` last) when ``peer`` is connected only through a relay or cannot be dialled
        directly. ``relay=True`` dials through a relay (the direct dial already failed), unless the
        file's known size exceeds what a circuit carries: then a provider not connected directly is
        skipped without a dial."""
        if peer in tried:
            return True
        if not relay and self._relayed_only(peer):
            return False
        size = verifier.exact_size if verifier.exact_size is not None else verifier.file_size
        direct = peer in self.host.connected_peers() and not self._relayed_only(peer)
        if relay and size is not None and size > self.relay_data_limit and not direct:
            # it would be reached (or is) only through a relay, and the circuit would be cut before the
            # file arrived: bulk content never goes through relays, nor does a circuit open for it
            tried.add(peer)
            report.relay_skipped.append(peer)
            report.attempts.append(f"{peer}: reachable only through a relay, whose circuits carry at most "
                                   f"{self.relay_data_limit} bytes; this file is {size}")
            log.info("fetch %s: %s", verifier.root, report.attempts[-1])
            return True
        try:
            await self._reach(peer, info, direct=not relay or peer in self.host.connected_peers(),
                              relay=relay)
        except NetError as exc:
            if not relay and not isinstance(exc, _NoAddress):
                report.direct_failed[peer] = str(exc)
                return False
            tried.add(peer)
            report.unreached.append(peer)
            failed = report.direct_failed.get(peer, "")
            report.attempts.append(f"{peer}: {exc}" + (f" (directly: {failed})" if failed else ""))
            log.info("fetch %s: %s", verifier.root, report.attempts[-1])
            return True
        tried.add(peer)
        before = report.fetched_blocks
        protocol = self._protocol_for(peer, via)
        try:
            if protocol == VIA_BLOCKS:
                try:
                    await fetch_from_peer(self.host, peer, verifier, on_block, idle_timeout=self.idle_timeout)
                except ProtocolNotSupported as exc:
                    if via != VIA_AUTO:
                        raise
                    # a plain IPFS node: the same fetch goes on over Bitswap from the same block
                    log.info("fetch %s: %s; asking over Bitswap", verifier.root, exc)
                    self._no_blocks[peer] = trio.current_time()
                    protocol = VIA_BITSWAP
            if protocol == VIA_BITSWAP:
                await self.bitswap.fetch_from_peer(peer, verifier, on_block, idle_timeout=self.idle_timeout)
            if not verifier.done:
                report.attempts.append(f"{peer}: lacks block {verifier.expected()}")
        except FileSizeError as exc:  # the transfer stops here (the stream is reset)
            report.refused = str(exc)
            log.info("fetch %s from %s: refused: %s", verifier.root, peer, exc)
        except (NetError, CIDError) as exc:
            if isinstance(exc, CIDError):
                report.corrupt.append(peer)
            report.attempts.append(f"{peer}: {exc}")
            log.info("fetch %s: %s", verifier.root, report.attempts[-1])
        if report.fetched_blocks > before and peer not in report.providers_used:
            report.providers_used.append(peer)
            report.protocols[peer] = protocol
        return True

    def _protocol_for(self, peer: str, via: str) -> str:
        """The protocol to ask ``peer`` first: ``via`` if forced, else ours unless it recently refused it."""
        if via != VIA_AUTO:
            return via
        refused_at = self._no_blocks.get(peer)
        if refused_at is not None and trio.current_time() - refused_at < NO_BLOCKS_TTL:
            return VIA_BITSWAP
        self._no_blocks.pop(peer, None)
        return VIA_BLOCKS

    def _relayed_only(self, peer: str) -> bool:
        """Is ``peer`` connected, and only over a relay?"""
        reach = getattr(self.host, "reach", None)
        try:
            return reach is not None and reach._only_relayed(to_libp2p_id(peer))
        except Exception:  # noqa: BLE001 - not a peer ID we can parse: not connected either
            return False

    async def reach(self, peer: str) -> None:
        """Be connected to ``peer`` (by peer ID), its addresses found in the DHT if we hold none: a restarted
        agent knows few (NetError if none is found or none answers)."""
        await self._reach(peer, None)

    async def _reach(self, peer: str, info: PeerInfo | None, *, direct: bool = True, relay: bool = True) -> None:
        """Be connected to ``peer``, dialing its known or DHT-found addresses (one deadline each):
        ``direct`` its own addresses, ``relay`` through a relay (see ``Host.connect``)."""
        if peer in self.host.connected_peers():
            return
        if info is None or not info.addrs:
            info = await self.discovery.find_peer(peer)
            if info is None:
                raise _NoAddress(f"no address known for {peer}")
        await self.host.connect(info, timeout=self.idle_timeout, direct=direct, relay=relay)


class _NoAddress(NetError):
    """No address of the provider is known, nor found in the DHT: no relay can help either."""


def _parse_providers(providers: Sequence[str]) -> list[tuple[str, PeerInfo | None]]:
    """Peer IDs or /p2p/ multiaddrs → (peer ID, addresses if given); NetConfigError naming a bad one."""
    out: list[tuple[str, PeerInfo | None]] = []
    for i, text in enumerate(providers):
        if text.startswith("/"):
            info = parse_peer_multiaddr(text, f"providers[{i}]")
            out.append((info.peer_id.to_base58(), info))
        else:
            try:
                public_key_from_peer_id(text)
            except KeyFileError as exc:
                raise NetConfigError(f"providers[{i}]: {exc}") from None
            out.append((text, None))
    return out


@asynccontextmanager
async def open_content(host: Host, discovery: Discovery, data_dir: str | os.PathLike[str], *,
                       ipfs_api: str | None = None, idle_timeout: float = 30.0,
                       max_file_size: int | None = None) -> AsyncIterator[ContentService]:
    """The content room of a running network; blocks live in ``<data_dir>/blocks``."""
    store = BlockStore(Path(data_dir) / "blocks")
    ipfs = IpfsDaemon(ipfs_api) if ipfs_api else None
    service = ContentService(host, discovery, store, ipfs=ipfs, idle_timeout=idle_timeout,
                             max_file_size=max_file_size)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        if ipfs is not None:
            ipfs.close()
