"""Stream safety: inbound handlers run inside a guard, and every length a peer sends is bounded.

Rules of this file (they exist because of how py-libp2p 0.8.1 behaves):
- An exception that escapes a stream handler tears down the connection's task tree (and with it
  the host's services); a ``StreamEOF`` that escapes stalls the connection. So no handler is ever
  registered bare: ``guard_handler`` catches every ``Exception``, counts it against the peer, and
  resets the stream. Cancellation (``trio.Cancelled``, a BaseException) passes through untouched.
- A stream that is never closed leaks on both sides. When a guarded handler returns, the guard
  closes the stream; when it fails, the guard resets it.
- A guarded handler runs under a deadline (``timeout``); a peer that opens a stream and goes silent
  cannot hold it forever.
- Every length prefix read from a peer is compared with a maximum before anything is allocated
  (``FrameReader.read_frame``). A violation is a ``PeerProtocolError`` naming what was too long.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.exceptions import BaseLibp2pError

from agent.net.errors import NetError, PeerProtocolError
from protocol.cid import varint_encode

log = logging.getLogger(__name__)

StreamHandler = Callable[[Any], Awaitable[None]]

MAX_VARINT_BYTES = 9  # 63 bits: more than any length we accept


def remote_peer(stream: Any) -> str:
    """The remote peer ID of a libp2p stream, as text (``"?"`` if the stream has none)."""
    try:
        return stream.muxed_conn.peer_id.to_base58()
    except Exception:  # a stream of a closing connection may have lost its muxed_conn
        return "?"


async def close_quietly(stream: Any, timeout: float = 2.0) -> None:
    """Close a stream, never raising: it may already be closed, reset or half-gone."""
    with trio.move_on_after(timeout):
        try:
            await stream.close()
        except Exception:
            pass


async def reset_quietly(stream: Any, timeout: float = 2.0) -> None:
    """Reset a stream, never raising."""
    with trio.move_on_after(timeout):
        try:
            await stream.reset()
        except Exception:
            pass


class HandlerGuard:
    """Wraps stream handlers so that nothing a peer does can escape into py-libp2p.

    ``errors`` counts handler failures per remote peer ID; ``timeouts`` counts handlers that ran
    past their deadline.
    """

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.timeouts: Counter[str] = Counter()

    def wrap(self, handler: StreamHandler, *, name: str, timeout: float | None = None) -> StreamHandler:
        async def guarded(stream: Any) -> None:
            peer = remote_peer(stream)
            try:
                if timeout is None:
                    await handler(stream)
                else:
                    with trio.move_on_after(timeout) as scope:
                        await handler(stream)
                    if scope.cancelled_caught:
                        self.timeouts[peer] += 1
                        log.debug("%s: handler for %s ran past %.0f s; resetting", name, peer, timeout)
                        await reset_quietly(stream)
                        return
            except Exception as exc:  # noqa: BLE001 - the whole point: nothing escapes
                self.errors[peer] += 1
                log.debug("%s: handler for %s failed: %r", name, peer, exc)
                await reset_quietly(stream)
                return
            await close_quietly(stream)

        guarded.__name__ = f"guarded_{name}"
        return guarded


class FrameReader:
    """Buffered reads from a libp2p stream: exact byte counts, uvarints, length-prefixed frames.

    Reads in large chunks (one ``stream.read`` per chunk, not per byte) because every read through
    py-libp2p's Yamux costs far more than copying bytes.
    """

    def __init__(self, stream: Any, *, chunk: int = 1 << 20) -> None:
        self._stream = stream
        self._chunk = chunk
        self._buf = bytearray()
        self._eof = False

    async def _fill(self) -> bool:
        """Read one more chunk; False at end of stream."""
        if self._eof:
            return False
        try:
            data = await self._stream.read(self._chunk)
        except EOFError:  # StreamEOF and MuxedStreamEOF both derive from it
            self._eof = True
            return False
        except Exception as exc:  # reset, connection closed, muxer error
            raise PeerProtocolError(f"stream from {remote_peer(self._stream)} failed: {type(exc).__name__}") from None
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def at_eof(self) -> bool:
        """True when the peer closed its side and every byte has been consumed."""
        while not self._buf:
            if not await self._fill():
                return True
        return False

    async def read_exactly(self, n: int, what: str = "data") -> bytes:
        while len(self._buf) < n:
            if not await self._fill():
                raise PeerProtocolError(
                    f"{what}: stream from {remote_peer(self._stream)} ended after {len(self._buf)} of {n} bytes"
                )
        with memoryview(self._buf) as view:
            out = bytes(view[:n])  # one copy (a slice of the bytearray would copy twice)
        del self._buf[:n]
        return out

    async def read_uvarint(self, what: str = "length") -> int:
        value = 0
        for i in range(MAX_VARINT_BYTES):
            while not self._buf:
                if not await self._fill():
                    raise PeerProtocolError(f"{what}: stream from {remote_peer(self._stream)} ended inside a varint")
            b = self._buf[0]
            del self._buf[:1]
            value |= (b & 0x7F) << (7 * i)
            if not b & 0x80:
                return value
        raise PeerProtocolError(f"{what}: varint from {remote_peer(self._stream)} longer than {MAX_VARINT_BYTES} bytes")

    async def read_frame(self, max_len: int, what: str = "frame") -> bytes:
        """One uvarint-length-prefixed frame; the length is checked before the body is read."""
        n = await self.read_uvarint(what)
        if n > max_len:
            raise PeerProtocolError(f"{what}: peer {remote_peer(self._stream)} sent length {n} > limit {max_len}")
        return await self.read_exactly(n, what)


def frame(payload: bytes) -> bytes:
    """uvarint length prefix + payload."""
    return varint_encode(len(payload)) + payload


async def request_frames(host: Any, peer: str, protocol: str, request: bytes, *, max_frame: int, max_frames: int,
                         max_bytes: int, what: str, timeout: float, open_timeout: float = 10.0) -> list[bytes]:
    """Ask ``peer`` over ``protocol``: write ``request``, close our side, read frames until the empty
    end frame. At most ``max_frames`` frames of ``max_frame`` bytes and ``max_bytes`` in all, within
    ``timeout``. NetError or PeerProtocolError naming the peer on failure; TooSlowError after ``timeout``.
    The stream is closed when all went well, reset otherwise. ``open_timeout``: how long the stream may
    take to open (its multistream negotiation answered), at most ``timeout``."""
    stream = await host.open_stream(peer, [protocol], timeout=min(open_timeout, timeout))
    ok = False
    try:
        with trio.fail_after(timeout):
            try:
                await stream.write(request)
                await stream.close()
            except (BaseLibp2pError, OSError) as exc:  # e.g. "Write operation failed: ... Broken pipe"
                # a raw py-libp2p error used to escape here: the soak saw it end a coordinator's verification
                # task (no verdict, the shard's window ran out) instead of the keep's retry loop taking it
                raise NetError(f"{protocol} to {peer}: the request could not be sent: "
                               f"{type(exc).__name__}: {exc}") from None
            reader = FrameReader(stream)
            out: list[bytes] = []
            total = 0
            while True:
                data = await reader.read_frame(max_frame, f"{protocol} {what}")
                if not data:
                    break
                out.append(data)
                total += len(data)
                if len(out) > max_frames or total > max_bytes:
                    raise PeerProtocolError(f"{protocol}: {peer} sent more than {max_frames} {what}s or "
                                            f"{max_bytes} bytes")
        ok = True
        return out
    finally:
        await (close_quietly(stream) if ok else reset_quietly(stream))
