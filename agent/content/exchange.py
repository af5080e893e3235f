"""/infernet/blocks/1.0.0: a file's DAG streamed over one stream, checked block by block.

Wire (one stream per request; uvarint is unsigned LEB128):
    client → server: uvarint(n) + n bytes, n ≤ MAX_REQUEST_BYTES: canonical msgpack
                     ``{"want": [CID bytes, ...]}`` with 1..MAX_WANTS entries; then the client
                     closes its write side.
    server → client: for each wanted CID in order, every block of its DAG in DFS pre-order (root
                     first, links in file order), each as ``uvarint(len(block) + 1) + block``.
                     ``uvarint(0)`` means "I do not have the next block"; the server stops there.
                     The server closes the stream after the last block.

The request's rules are protocol/blocks.py's (vectors: ipips/vectors/blocks-request.json).
/infernet/blocks/1.1.0 is the same wire, and its request may also carry ``"wait": ms`` (0..MAX_WAIT_MS):
when the next block is one the server lacks, it waits up to that long for the block to arrive in its store
(a peer fetching the same file meanwhile) before it says ``uvarint(0)``; each block it lacks gets its own
wait. A swarm member (IPIP-0003 §4.2) asks another this way, so the blocks flow on one busy stream as they
arrive, instead of a stream opened, and a TCP window grown again, for each ask. And ``"shallow": true``:
each wanted CID's own block only, not the DAG under it (a swarm's first ask: the root alone).

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
from protocol.blocks import (MAX_REQUEST_BYTES, MAX_WAIT_MS, MAX_WANTS, PROTOCOL, PROTOCOL_WAIT,
                             encode_request, parse_request)
from protocol.errors import CIDError, CodecError
from protocol.unixfs import MAX_BLOCK_SIZE, StreamVerifier, decode_node, verify_block

log = logging.getLogger(__name__)

WAIT_STEP = 0.02  # how often a waiting server looks for the block in its store
IDLE_TIMEOUT = 30.0
PIPELINE_DEPTH = 4  # batches read from disk ahead of the network task (server)
BATCH_BYTES = 1 << 20  # the server reads and writes blocks in batches of about this many bytes
CHECK_QUEUE_BYTES = 8 << 20  # received blocks waiting to be checked, at most (client)
NOT_HAVE = varint_encode(0)


def decode_request(body: bytes, peer: str, protocol: str = PROTOCOL) -> tuple[list[CID], int, bool]:
    """The wanted CIDs of a request body, its wait in ms and whether it is shallow (protocol/blocks.py);
    PeerProtocolError naming the peer if malformed."""
    try:
        return tuple(parse_request(body, protocol))  # type: ignore[return-value]
    except CodecError as exc:
        raise PeerProtocolError(f"{protocol} request from {peer}: {exc}") from None


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
        host.set_handler(PROTOCOL_WAIT, self.handle_wait, timeout=None)

    async def handle_wait(self, stream: Any) -> None:
        await self.handle(stream, PROTOCOL_WAIT)

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

    async def handle(self, stream: Any, protocol: str = PROTOCOL) -> None:
        peer = remote_peer(stream)
        reader = FrameReader(stream, chunk=MAX_REQUEST_BYTES)
        with trio.fail_after(self.idle_timeout):
            wants, wait_ms, shallow = decode_request(
                await reader.read_frame(MAX_REQUEST_BYTES, f"{protocol} request"), peer, protocol)
        # a walker task reads blocks in worker threads, a batch at a time, while this task writes
        # the previous batch: disk and network overlap, and a thread hop serves several blocks
        send, receive = trio.open_memory_channel[list[bytes | None]](PIPELINE_DEPTH)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._walk, wants, send, wait_ms / 1000, shallow)
            async with receive:
                async for batch in receive:
                    lacks = bool(batch) and batch[-1] is None
                    blocks = batch[:-1] if lacks else batch
                    parts: list[bytes] = []
                    for data in blocks:
                        parts += (varint_encode(len(data) + 1), data)  # type: ignore[arg-type]
                    out = b"".join(parts)  # the blocks are copied once
                    if not out and not lacks:
                        continue
                    with trio.fail_after(self.idle_timeout):
                        await stream.write(out + NOT_HAVE if lacks else out)
                    self.blocks_served += len(blocks)
                    self.bytes_served += sum(len(data) for data in blocks)  # type: ignore[arg-type]
                    if lacks:
                        break
            nursery.cancel_scope.cancel()

    async def _walk(self, wants: list[CID], send: trio.MemorySendChannel, wait: float = 0.0,
                    shallow: bool = False) -> None:
        """DFS pre-order over the wanted DAGs (``shallow``: their roots only), in batches; a batch ending in None is
        the last: the next block is one we lack (after waiting up to ``wait`` seconds for it to be stored)."""
        async with send:
            pending = list(reversed(wants))
            while pending:
                batch = await trio.to_thread.run_sync(self._read_batch, pending, shallow)
                if batch and batch[-1] is None and wait > 0:
                    await send.send(batch[:-1])  # what we had goes out while we wait for the next one
                    if await self._stored_within(pending[-1], wait):
                        continue
                    batch = [None]
                await send.send(batch)
                if batch and batch[-1] is None:
                    return

    async def _stored_within(self, cid: CID, wait: float) -> bool:
        with trio.move_on_after(wait):
            while not self.store.has(cid):
                await trio.sleep(WAIT_STEP)
            return True
        return False

    def _read_batch(self, pending: list[CID], shallow: bool = False) -> list[bytes | None]:
        """The next blocks in DFS order (``shallow``: no children), up to BATCH_BYTES (at least one); ``pending``
        is the stack (a block we lack stays on it, and the batch ends in None)."""
        batch: list[bytes | None] = []
        size = 0
        while pending and size < BATCH_BYTES:
            found = self._block_and_links(pending[-1])
            if found is None:
                batch.append(None)
                break
            pending.pop()
            data, children = found
            if not shallow:
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
    wait: float = 0.0,
) -> bool:
    """Stream the verifier's remaining subtrees from ``peer``, feeding every block through it.

    ``wait`` (seconds, > 0): over PROTOCOL_WAIT, the peer waits that long for each block it lacks yet
    (ProtocolNotSupported from a peer without it).

    ``on_block(cid, block, payload)`` runs for each verified block (store it, write its payload).
    Returns True when the file is complete, False when the peer said it lacks the next block.
    Raises NetError (no stream), PeerProtocolError (broken or silent stream) or CIDError (a block
    that does not match its CID, named in the message); the verifier keeps its position.
    """
    while not verifier.done:
        remaining = verifier.remaining()
        wants = remaining[:MAX_WANTS]
        untouched = len(remaining) - len(wants)  # subtrees left for a later request
        if not await _fetch_batch(host, peer, verifier, wants, untouched, on_block, idle_timeout, wait):
            return False
    return True


async def fetch_block(host: Host, peer: str, cid: CID, *, idle_timeout: float = IDLE_TIMEOUT) -> bytes:
    """The one block ``cid`` from ``peer`` (a shallow request over PROTOCOL_WAIT), hash-checked; NetError (no
    stream; ProtocolNotSupported from a peer without 1.1.0), PeerProtocolError (it lacks the block, or broke
    the stream) or CIDError (the bytes do not match ``cid``)."""
    stream = await host.open_stream(peer, [PROTOCOL_WAIT], timeout=idle_timeout)
    ok = False
    try:
        reader = FrameReader(stream)
        with trio.fail_after(idle_timeout):
            await stream.write(encode_request([cid], shallow=True))
            await stream.close()
            n = await reader.read_uvarint(f"{PROTOCOL_WAIT} block length")
            if n == 0:
                raise PeerProtocolError(f"{PROTOCOL_WAIT}: {peer} lacks block {cid}")
            if n - 1 > MAX_BLOCK_SIZE:
                raise PeerProtocolError(f"{PROTOCOL_WAIT}: {peer} announced a {n - 1} byte block "
                                        f"(limit {MAX_BLOCK_SIZE})")
            data = await reader.read_exactly(n - 1, f"{PROTOCOL_WAIT} block")
        verify_block(cid, data)
        ok = True
        return data
    except trio.TooSlowError:
        raise PeerProtocolError(f"{PROTOCOL_WAIT}: {peer} sent no block {cid} within {idle_timeout:.0f} s") from None
    finally:
        await (close_quietly(stream) if ok else reset_quietly(stream))


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The exception that failed a nursery (the others in it are cancellations it caused)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return first_error(exc)
        if not isinstance(exc, trio.Cancelled):
            return exc
    return group


async def _fetch_batch(host: Host, peer: str, verifier: StreamVerifier, wants: list[CID], untouched: int,
                       on_block: Callable[[CID, bytes, bytes], None], idle_timeout: float, wait: float = 0.0) -> bool:
    """One request: True when the wanted subtrees are complete, False if the peer lacks a block."""
    wait_ms = min(MAX_WAIT_MS, round(wait * 1000))
    protocol = PROTOCOL_WAIT if wait_ms else PROTOCOL
    stream = await host.open_stream(peer, [protocol], timeout=idle_timeout)
    ok = False
    try:
        with trio.fail_after(idle_timeout):
            await stream.write(encode_request(wants, wait_ms))
            await stream.close()  # a half-close: the request is complete
        # this task reads frames; a checker thread verifies, stores and writes them out (hashing
        # and file writes release the GIL), so receiving and checking overlap
        checker = _Checker(verifier, on_block)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(checker.run)
                try:
                    lacks = await _read_blocks(FrameReader(stream), peer, checker, idle_timeout, protocol)
                except BaseException:
                    checker.close(abort=True)
                    raise
                checker.close()
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        if len(verifier.remaining()) > untouched:
            if lacks:
                return False
            raise PeerProtocolError(f"{protocol}: {peer} ended the stream before block {verifier.expected()}")
        ok = True
        return True
    finally:
        await (close_quietly(stream) if ok else reset_quietly(stream))


async def _read_blocks(reader: FrameReader, peer: str, checker: _Checker, idle_timeout: float,
                       protocol: str = PROTOCOL) -> bool:
    """Forward frames until the stream ends; True if the peer said it lacks the next block."""
    while True:
        try:
            with trio.fail_after(idle_timeout):
                if await reader.at_eof():
                    return False
                n = await reader.read_uvarint(f"{protocol} block length")
                if n == 0:
                    return True
                if n - 1 > MAX_BLOCK_SIZE:
                    raise PeerProtocolError(f"{protocol}: {peer} announced a {n - 1} byte block "
                                            f"(limit {MAX_BLOCK_SIZE})")
                data = await reader.read_exactly(n - 1, f"{protocol} block")
        except trio.TooSlowError:
            raise PeerProtocolError(f"{protocol}: {peer} sent nothing for {idle_timeout:.0f} s") from None
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
