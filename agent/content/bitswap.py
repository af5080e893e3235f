"""Bitswap (/ipfs/bitswap/1.2.0, 1.1.0, 1.0.0) over the agent's blockstore, so IPFS nodes can fetch our CIDs.

Rules of this file:
- py-libp2p's BitswapClient serves and receives blocks; its block store is our on-disk BlockStore
  (``_StoreAdapter``), so every block we hold is served and every block it receives is hash-checked
  by ``BlockStore.put`` before it is stored. py-libp2p's MerkleDag builder is never used: its DAGs are
  not Kubo's (see protocol/unixfs.py); our blocks come from protocol/unixfs.
- ``_Client`` corrects three things py-libp2p 0.8.1 does against the Bitswap spec, each of which
  broke transfers with Helia, Kubo or our own agents (tests/interop/test_helia_bitswap.py):
  1. Answers go on OUR outbound stream to the asking peer (``_process_wantlist``). py-libp2p writes
     them back on the asker's stream, which go and js implementations only write to and close: a
     Helia or Kubo peer never saw a block from us. A want-have is answered with HAVE (or the block
     itself when it is at most ``HAVE_AS_BLOCK_MAX`` bytes, as Kubo does), a want-block with the
     block, a block we lack with DONT_HAVE when the asker asked for that. Block prefixes are written
     for CIDv0 too (py-libp2p sends an empty one, which no receiver can turn back into the CID).
     Blocks are read from the store as the queue drains (at most ``MAX_QUEUED_BYTES`` waiting per
     peer), where py-libp2p read every block a wantlist named into memory at once.
  2. Our outbound stream stays open for the queue's later messages. py-libp2p's reader on it closes
     it as soon as it expects no block from that peer, which for a stream opened to answer wants is
     at once: the answer went out after the FIN and the peer discarded it. Our reader
     (``_read_inline_answers``) only listens, for peers that answer on our stream as py-libp2p's
     stock server does, and leaves closing to the queue.
  3. A peer's inbound stream is read for as long as the peer sends on it (one stream per peer is how
     Kubo >= 0.37 and py-libp2p's queue send every want). After ``INBOUND_IDLE`` seconds of silence
     it is RESET, not closed: py-libp2p closes it with a FIN, the sender never notices, keeps
     writing wants to a stream nobody reads, and every fetch after a minute's pause failed. A reset
     fails the sender's next write, and the sender opens a new stream. Our own sender (``_Queue``)
     then writes the same messages again on the new stream, as Kubo's message sender does, instead
     of dropping them and leaving the other side to ask again later.
  4. ``stop`` resets every inbound stream the client is still reading. py-libp2p leaves their
     reader tasks running (they belong to the connection, not to the client): a peer's queue kept
     writing blocks on its old stream into the stopped client's store, and a later client on the
     same host waited out every window of its fetch for blocks that had gone there
     (scripts/bench_net.py stalled for minutes). A reset makes the peer open a new stream.
- Fetching never calls py-libp2p's ``fetch_file`` (it retries forever). ``fetch_from_peer`` is our
  own want-loop: it asks for a window of the blocks the StreamVerifier will need next, waits at most
  ``idle_timeout`` for each window, then feeds the verifier in DFS order from the store. A window
  that brings nothing ends the attempt with PeerProtocolError naming the block still missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.bitswap.block_store import BlockStore as Libp2pBlockStore
from libp2p.bitswap.cid import cid_to_bytes
from libp2p.bitswap.client import BitswapClient
from libp2p.bitswap.config import BITSWAP_PROTOCOL_V100, BITSWAP_PROTOCOL_V120
from libp2p.bitswap.message_queue import BitswapMessageQueue
from libp2p.bitswap.pb.bitswap_pb2 import Message
from libp2p.peer.id import ID

from agent.content.blockstore import BlockStore
from agent.net.errors import PeerProtocolError
from agent.net.host import Host
from agent.net.streams import reset_quietly
from protocol.cid import CID, SHA2_256, varint_encode
from protocol.errors import CIDError
from protocol.unixfs import StreamVerifier

log = logging.getLogger(__name__)
# py-libp2p 0.8.1 logs every received block at INFO, several lines each
logging.getLogger("libp2p.bitswap.client").setLevel(logging.WARNING)

WINDOW = 32  # blocks wanted at once (8 MiB of 256 KiB chunks)
INLINE_ANSWER_IDLE = 60.0  # stop listening for inline answers on our stream after this long silent
INBOUND_IDLE = 60.0  # reset a peer's silent inbound stream after this long (py-libp2p's own figure)
MAX_QUEUED_BYTES = 8 << 20  # blocks waiting to be written to one peer; its further wants wait
HAVE_AS_BLOCK_MAX = 1024  # Kubo's maxBlockSizeReplaceHasWithBlock: a tiny block beats a HAVE round trip


def _our_cid(cid: Any) -> CID:
    return CID.from_bytes(cid_to_bytes(cid))


class _StoreAdapter(Libp2pBlockStore):
    """py-libp2p's BlockStore interface over our BlockStore."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.rejected = 0

    async def get_block(self, cid: Any) -> bytes | None:
        try:
            return self.store.get(_our_cid(cid))
        except CIDError:
            return None

    async def put_block(self, cid: Any, data: bytes) -> None:
        try:
            self.store.put(_our_cid(cid), data)
        except CIDError as exc:  # never store what does not match; the want-loop will notice
            self.rejected += 1
            log.warning("bitswap: rejected a block: %s", exc)

    async def has_block(self, cid: Any) -> bool:
        try:
            return self.store.has(_our_cid(cid))
        except CIDError:
            return False

    async def delete_block(self, cid: Any) -> None:
        self.store.delete(_our_cid(cid))

    def get_all_cids(self) -> list[bytes]:
        # we key blocks by digest; their CIDs (codec) are not recorded, so none can be listed
        return []


def _block_prefix(cid: CID) -> bytes:
    """The Bitswap 1.1+ block prefix: version, codec, multihash type and length (for v0 too)."""
    return varint_encode(cid.version) + varint_encode(cid.codec) + varint_encode(SHA2_256) + varint_encode(32)


class _Queue(BitswapMessageQueue):
    """py-libp2p's per-peer message queue, writing once more on a new stream when the old one fails."""

    async def _flush_messages(self, **messages: Any) -> None:
        had_stream = self._stream is not None
        await super()._flush_messages(**messages)
        if had_stream and self._stream is None:  # the write failed (a reset stream) and it was dropped
            await super()._flush_messages(**messages)  # a repeated want or block is harmless


class _Client(BitswapClient):
    """py-libp2p's BitswapClient with wants answered on our outbound stream (see the rules above)."""

    block_store: _StoreAdapter

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inbound: dict[Any, trio.CancelScope] = {}  # the inbound streams being read, to end at stop

    async def _handle_stream(self, stream: Any) -> None:
        """Serve one inbound stream until the peer closes it; reset it after INBOUND_IDLE silent,
        or when this client stops."""
        peer_id = stream.muxed_conn.peer_id
        if protocol := stream.get_protocol():
            self._peer_protocols[peer_id] = str(protocol)
        with trio.CancelScope() as scope:
            self._inbound[stream] = scope
            try:
                while True:
                    message = None
                    with trio.move_on_after(INBOUND_IDLE) as idle:
                        message = await self._read_message(stream)  # None at EOF or on a bad message
                    if idle.cancelled_caught:
                        break
                    if message is None:
                        return
                    await self._process_message(message, peer_id, stream)  # an error: HandlerGuard resets
            finally:
                self._inbound.pop(stream, None)
        await reset_quietly(stream)  # silent, or this client stopped: the peer opens a new stream

    async def stop(self) -> None:
        """Stop, and end every inbound stream still being read (rule 4)."""
        for scope in list(self._inbound.values()):
            scope.cancel()
        await super().stop()

    def get_or_create_message_queue(self, peer_id: ID) -> BitswapMessageQueue:
        if peer_id not in self._message_queues:
            queue = _Queue(host=self.host, peer_id=peer_id, supported_protocols=self.supported_protocols,
                           on_stream_opened=self._on_message_queue_stream_opened)
            if self._nursery is not None:
                queue.start(self._nursery)
            self._message_queues[peer_id] = queue
        return self._message_queues[peer_id]

    def _on_message_queue_stream_opened(self, stream: Any, peer_id: ID) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._read_inline_answers, stream, peer_id)

    async def _read_inline_answers(self, stream: Any, peer_id: ID) -> None:
        while True:
            message = None
            with trio.move_on_after(INLINE_ANSWER_IDLE):
                message = await self._read_message(stream)  # None at EOF or on a bad message
            if message is None:
                return
            try:
                await self._process_message(message, peer_id, stream)
            except Exception as exc:  # a peer's bad message (a bad CID prefix...) ends this reader only
                log.info("bitswap: dropped a message from %s: %s: %s", peer_id, type(exc).__name__, exc)
                return

    async def _process_wantlist(self, wantlist: Any, peer_id: ID, stream: Any) -> None:
        # Wants we cannot answer now are not remembered (blocks reach our store without passing the
        # client, so nothing would ever answer them); the asker gets DONT_HAVE if it asked for that.
        queue = self.get_or_create_message_queue(peer_id)
        old_format = self._peer_protocols.get(peer_id) == BITSWAP_PROTOCOL_V100
        for entry in wantlist.entries:
            if entry.cancel:
                continue  # everything we answer is already queued
            try:
                cid = CID.from_bytes(entry.block)
            except CIDError:
                continue  # not a CID we could hold (another hash, a bad one): nothing to say
            data = self.block_store.store.get(cid)
            if data is None:
                if entry.sendDontHave:
                    queue.add_presences([(entry.block, False)])
            elif entry.wantType == Message.Wantlist.Have and len(data) > HAVE_AS_BLOCK_MAX:
                queue.add_presences([(entry.block, True)])
            else:
                await _room_for_blocks(queue)
                if old_format:
                    queue.add_blocks_v100([data])
                else:
                    queue.add_blocks_v110([(_block_prefix(cid), data)])


async def _room_for_blocks(queue: BitswapMessageQueue) -> None:
    """Wait until the peer's queue holds less than MAX_QUEUED_BYTES of blocks (TooSlowError after
    INBOUND_IDLE): a wantlist naming thousands of our blocks must not load them all into memory."""
    def queued() -> int:
        return (sum(len(data) for data in queue._pending_blocks_v100)
                + sum(len(data) for _, data in queue._pending_blocks_v110))

    with trio.fail_after(INBOUND_IDLE):
        while queued() >= MAX_QUEUED_BYTES:
            await trio.sleep(0.005)


class BitswapExchange:
    def __init__(self, host: Host, store: BlockStore) -> None:
        self.host = host
        self.store = store
        self.adapter = _StoreAdapter(store)
        self.client = _Client(host.libp2p, block_store=self.adapter, protocol_version=BITSWAP_PROTOCOL_V120)

    async def start(self) -> None:
        self.client.set_nursery(self.host.nursery)
        await self.client.start()

    async def stop(self) -> None:
        with trio.move_on_after(5):
            await self.client.stop()

    async def fetch_from_peer(self, peer: str, verifier: StreamVerifier,
                              on_block: Callable[[CID, bytes, bytes], None], *,
                              idle_timeout: float = 30.0, window: int = WINDOW) -> bool:
        """Fetch the verifier's remaining blocks from ``peer`` over Bitswap; True when complete."""
        session = self.client.new_session()
        peer_id = ID.from_base58(peer)
        while not verifier.done:
            need = [cid for cid in verifier.remaining()[:window] if not self.store.has(cid)]
            if need:
                with trio.move_on_after(idle_timeout + 1):
                    await session.get_blocks_batch([cid.to_bytes() for cid in need], peer_id=peer_id,
                                                   timeout=idle_timeout, batch_size=window)
            progressed = False
            while (cid := verifier.expected()) is not None:
                data = self.store.get(cid)
                if data is None:
                    break
                on_block(cid, data, verifier.feed(data))
                progressed = True
            if not progressed:
                raise PeerProtocolError(f"bitswap: {peer} did not send block {verifier.expected()} "
                                        f"within {idle_timeout:.0f} s")
        return True
