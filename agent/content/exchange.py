"""/infernet/blocks/1.0.0: a file's DAG streamed over one stream, checked block by block.

Wire (one stream per request; uvarint is unsigned LEB128):
    client → server: uvarint(n) + n bytes, n ≤ MAX_REQUEST_BYTES: canonical msgpack
                     ``{"want": [CID bytes, ...]}`` with 1..MAX_WANTS entries; then the client
                     closes its write side.
    server → client: for each wanted CID in order, every block of its DAG in DFS pre-order (root
                     first, links in file order), each as ``uvarint(len(block) + 1) + block``.
                     ``uvarint(0)`` means "I do not have the next block"; the server stops there.
                     The server closes the stream after the last block.

Rules of this file:
- The client never trusts the order or the bytes: it knows which CID must come next (a
  ``StreamVerifier``), and every block is hash-checked and structure-checked on arrival, before it
  is stored or its bytes are written out. A block that fails stops the stream with a CIDError naming
  the CID; the verifier is left where it was, so another provider can continue from there.
- Resuming is asking for ``StreamVerifier.remaining()``: the subtrees not yet received, next first.
- Every length is bounded before it is read (request ≤ MAX_REQUEST_BYTES, a block ≤ MAX_BLOCK_SIZE);
  every read and write has a deadline (``idle_timeout``), so a silent peer costs one timeout.
- The server walks its own blockstore and serves whatever it holds under the wanted CIDs; it stops at
  the first block it lacks, so a client never waits for a block that will not come. It does not
  re-hash what it serves (the store hash-checked every block on the way in; the client checks
  every block on arrival).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

import trio

from agent.content.blockstore import BlockStore
from agent.net.errors import PeerProtocolError
from agent.net.host import Host
from agent.net.streams import FrameReader, close_quietly, remote_peer, reset_quietly
from protocol.cid import CID, RAW, varint_encode
from protocol.codec import canonical_encode, decode_canonical
from protocol.errors import CIDError, CodecError
from protocol.unixfs import MAX_BLOCK_SIZE, StreamVerifier, decode_node

log = logging.getLogger(__name__)

PROTOCOL = "/infernet/blocks/1.0.0"
MAX_REQUEST_BYTES = 64 * 1024
MAX_WANTS = 1024
IDLE_TIMEOUT = 30.0
PIPELINE_DEPTH = 4  # batches read from disk ahead of the network task (server)
BATCH_BYTES = 1 << 20  # the server reads and writes blocks in batches of about this many bytes
CHECK_QUEUE_BYTES = 8 << 20  # received blocks waiting to be checked, at most (client)
NOT_HAVE = varint_encode(0)


def encode_request(wants: list[CID]) -> bytes:
    body = canonical_encode({"want": [cid.to_bytes() for cid in wants]})
    return varint_encode(len(body)) + body


def decode_request(body: bytes, peer: str) -> list[CID]:
    """The wanted CIDs of a request body; PeerProtocolError naming the peer if malformed."""
    try:
        request = decode_canonical(body, max_bytes=MAX_REQUEST_BYTES)
        if not isinstance(request, dict) or set(request) != {"want"}:
            raise CodecError("bad-request", "expected a map with exactly the key 'want'")
        wants = request["want"]
        if not isinstance(wants, list) or not 1 <= len(wants) <= MAX_WANTS:
            raise CodecError("bad-request", f"'want' must list 1..{MAX_WANTS} CIDs")
        if not all(isinstance(w, bytes) for w in wants):
            raise CodecError("bad-request", "'want' entries must be CID bytes")
        return [CID.from_bytes(w) for w in wants]
    except (CodecError, CIDError) as exc:
        raise PeerProtocolError(f"{PROTOCOL} request from {peer}: {exc}") from None


class BlockServer:
    """Serves the blockstore's DAGs on PROTOCOL. ``block`` is the one place bytes are read."""

    def __init__(self, store: BlockStore, *, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.store = store
        self.idle_timeout = idle_timeout
        self.blocks_served = 0
        self.bytes_served = 0

    def install(self, host: Host) -> None:
        # no total deadline: a large file takes long; every read and write has its own
        host.set_handler(PROTOCOL, self.handle, timeout=None)

    def block(self, cid: CID) -> bytes | None:
        return self.store.get_unchecked(cid)

    def _block_and_links(self, cid: CID) -> tuple[bytes, list[CID]] | None:
        """The block and its children's CIDs, or None if we lack it or cannot read its links.

        Not re-hashed: the store checked it on the way in and the client checks it on arrival
        (Kubo serves the same way, HashOnRead off). A block whose links do not decode is not served.
        """
        data = self.block(cid)
        if data is None:
            return None
        if cid.codec == RAW:
            return data, []
        try:
            return data, [link.cid for link in decode_node(data).links]
        except CIDError as exc:
            log.error("%s: not serving %s: %s", PROTOCOL, cid, exc)
            return None

    async def handle(self, stream: Any) -> None:
        peer = remote_peer(stream)
        reader = FrameReader(stream, chunk=MAX_REQUEST_BYTES)
        with trio.fail_after(self.idle_timeout):
            wants = decode_request(await reader.read_frame(MAX_REQUEST_BYTES, f"{PROTOCOL} request"), peer)
        # a walker task reads blocks in worker threads, a batch at a time, while this task writes
        # the previous batch: disk and network overlap, and a thread hop serves several blocks
        send, receive = trio.open_memory_channel[list[bytes | None]](PIPELINE_DEPTH)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._walk, wants, send)
            async with receive:
                async for batch in receive:
                    lacks = batch[-1] is None
                    blocks = batch[:-1] if lacks else batch
                    parts: list[bytes] = []
                    for data in blocks:
                        parts += (varint_encode(len(data) + 1), data)  # type: ignore[arg-type]
                    out = b"".join(parts)  # the blocks are copied once
                    with trio.fail_after(self.idle_timeout):
                        await stream.write(out + NOT_HAVE if lacks else out)
                    self.blocks_served += len(blocks)
                    self.bytes_served += sum(len(data) for data in blocks)  # type: ignore[arg-type]
                    if lacks:
                        break
            nursery.cancel_scope.cancel()

    async def _walk(self, wants: list[CID], send: trio.MemorySendChannel) -> None:
        """DFS pre-order over the wanted DAGs, in batches; a batch ending in None is the last:
        the next block is one we lack."""
        async with send:
            pending = list(reversed(wants))
            while pending:
                batch = await trio.to_thread.run_sync(self._read_batch, pending)
                await send.send(batch)
                if batch and batch[-1] is None:
                    return

    def _read_batch(self, pending: list[CID]) -> list[bytes | None]:
        """The next blocks in DFS order, up to BATCH_BYTES (at least one); ``pending`` is the stack."""
        batch: list[bytes | None] = []
        size = 0
        while pending and size < BATCH_BYTES:
            found = self._block_and_links(pending.pop())
            if found is None:
                batch.append(None)
                break
            data, children = found
            pending.extend(reversed(children))
            batch.append(data)
            size += len(data)
        return batch


async def fetch_from_peer(
    host: Host,
    peer: str,
    verifier: StreamVerifier,
    on_block: Callable[[CID, bytes, bytes], None],
    *,
    idle_timeout: float = IDLE_TIMEOUT,
) -> bool:
    """Stream the verifier's remaining subtrees from ``peer``, feeding every block through it.

    ``on_block(cid, block, payload)`` runs for each verified block (store it, write its payload).
    Returns True when the file is complete, False when the peer said it lacks the next block.
    Raises NetError (no stream), PeerProtocolError (broken or silent stream) or CIDError (a block
    that does not match its CID, named in the message); the verifier keeps its position.
    """
    while not verifier.done:
        remaining = verifier.remaining()
        wants = remaining[:MAX_WANTS]
        untouched = len(remaining) - len(wants)  # subtrees left for a later request
        if not await _fetch_batch(host, peer, verifier, wants, untouched, on_block, idle_timeout):
            return False
    return True


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception that failed a nursery (the others in it are cancellations it caused)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        if not isinstance(exc, trio.Cancelled):
            return exc
    return group


async def _fetch_batch(host: Host, peer: str, verifier: StreamVerifier, wants: list[CID], untouched: int,
                       on_block: Callable[[CID, bytes, bytes], None], idle_timeout: float) -> bool:
    """One request: True when the wanted subtrees are complete, False if the peer lacks a block."""
    stream = await host.open_stream(peer, [PROTOCOL], timeout=idle_timeout)
    ok = False
    try:
        with trio.fail_after(idle_timeout):
            await stream.write(encode_request(wants))
            await stream.close()  # a half-close: the request is complete
        # this task reads frames; a checker thread verifies, stores and writes them out (hashing
        # and file writes release the GIL), so receiving and checking overlap
        checker = _Checker(verifier, on_block)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(checker.run)
                try:
                    lacks = await _read_blocks(FrameReader(stream), peer, checker, idle_timeout)
                except BaseException:
                    checker.close(abort=True)
                    raise
                checker.close()
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        if len(verifier.remaining()) > untouched:
            if lacks:
                return False
            raise PeerProtocolError(f"{PROTOCOL}: {peer} ended the stream before block {verifier.expected()}")
        ok = True
        return True
    finally:
        await (close_quietly(stream) if ok else reset_quietly(stream))


async def _read_blocks(reader: FrameReader, peer: str, checker: _Checker, idle_timeout: float) -> bool:
    """Forward frames until the stream ends; True if the peer said it lacks the next block."""
    while True:
        try:
            with trio.fail_after(idle_timeout):
                if await reader.at_eof():
                    return False
                n = await reader.read_uvarint(f"{PROTOCOL} block length")
                if n == 0:
                    return True
                if n - 1 > MAX_BLOCK_SIZE:
                    raise PeerProtocolError(f"{PROTOCOL}: {peer} announced a {n - 1} byte block "
                                            f"(limit {MAX_BLOCK_SIZE})")
                data = await reader.read_exactly(n - 1, f"{PROTOCOL} block")
        except trio.TooSlowError:
            raise PeerProtocolError(f"{PROTOCOL}: {peer} sent nothing for {idle_timeout:.0f} s") from None
        if not await checker.put(data):
            return False  # the checker stopped on a bad block: run() raises it


class _Checker:
    """Feeds received blocks through the verifier in ONE worker thread for the whole request.

    A thread hop per block (or per batch) made the checking wait for the event loop between blocks,
    and the loop wait for the thread: under CPU contention the two barely overlapped. Here the
    network task only queues blocks (``put``); the thread takes them as they come. At most
    ``CHECK_QUEUE_BYTES`` wait unchecked (then ``put`` waits), so a fast peer cannot fill memory.
    ``close()`` lets the thread finish what is queued; ``close(abort=True)`` drops it (a failed or
    cancelled request). The thread always ends, so ``run`` (not cancellable: the verifier must not
    be touched after the request returns) never waits long. ``run`` raises the thread's error
    (CIDError naming the CID, FileSizeError); the verifier stays at the block that failed.
    """

    _END = object()

    def __init__(self, verifier: StreamVerifier, on_block: Callable[[CID, bytes, bytes], None], *,
                 max_bytes: int | None = None) -> None:
        self.verifier = verifier
        self.on_block = on_block
        self.max_bytes = CHECK_QUEUE_BYTES if max_bytes is None else max_bytes
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.queued = 0  # bytes put and not yet checked
        self.aborted = False
        self.finished = False
        self.error: BaseException | None = None
        self._space = trio.Event()
        self._waiting = False
        self._token = trio.lowlevel.current_trio_token()

    async def run(self) -> None:
        await trio.to_thread.run_sync(self._loop)
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        try:
            while True:
                data = self.queue.get()
                if data is self._END or self.aborted:
                    return
                try:
                    _feed(self.verifier, self.on_block, data)
                finally:
                    self.queued -= len(data)
                    if self._waiting:
                        self._token.run_sync_soon(self._space.set)
        except BaseException as exc:  # noqa: BLE001 - handed to run(), in the trio task
            self.error = exc
        finally:
            self.finished = True
            if self._waiting:
                self._token.run_sync_soon(self._space.set)

    async def put(self, data: bytes) -> bool:
        """Queue a block; False (nothing queued) once the thread has stopped on an error."""
        while self.queued >= self.max_bytes and not self.finished:
            self._space = trio.Event()
            self._waiting = True
            if self.queued < self.max_bytes or self.finished:  # the thread moved on meanwhile
                break
            await self._space.wait()
        self._waiting = False
        if self.finished:
            return False
        self.queued += len(data)
        self.queue.put(data)
        await trio.lowlevel.checkpoint()
        return True

    def close(self, *, abort: bool = False) -> None:
        self.aborted = self.aborted or abort
        self.queue.put(self._END)


def _feed(verifier: StreamVerifier, on_block: Callable[[CID, bytes, bytes], None], data: bytes) -> None:
    cid = verifier.expected()
    if cid is None:
        raise CIDError(f"file {verifier.root} is complete; the peer sent more blocks")
    on_block(cid, data, verifier.feed(data))
