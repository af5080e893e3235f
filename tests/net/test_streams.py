"""A peer that misbehaves on purpose cannot break an agent's host.

py-libp2p 0.8.1 lets an exception escape a stream handler into the connection's task tree, stalls
a connection on an escaped StreamEOF, and keeps unclosed streams. Every handler here is guarded;
this test throws each kind of misbehaviour at one agent and then checks it still serves streams
and gossip, counted the failures against the misbehaving peer, and kept no stream open.
"""

import pytest
import trio
from libp2p.network.stream.exceptions import StreamEOF

from agent.net.streams import FrameReader, frame
from protocol.cid import varint_encode
from protocol.messages import TOPIC_JOBS, Heartbeat
from tests.net.conftest import agents, wait_until

pytestmark = pytest.mark.network


async def test_misbehaving_peer_cannot_break_the_host():
    async with agents(2) as (a, b):
        async def raises(stream):
            raise RuntimeError("handler bug")

        async def raises_eof(stream):
            raise StreamEOF()

        async def reads_forever(stream):
            await stream.read(1)
            await trio.sleep_forever()

        async def echo_frame(stream):
            request = await FrameReader(stream).read_frame(1024, "echo request")
            await stream.write(frame(request[::-1]))

        a.host.set_handler("/test/raise/1", raises, timeout=5)
        a.host.set_handler("/test/eof/1", raises_eof, timeout=5)
        a.host.set_handler("/test/slow/1", reads_forever, timeout=0.5)
        a.host.set_handler("/test/echo/1", echo_frame, timeout=5)
        a_conn = a.host.libp2p.get_network().get_connections(b.host.libp2p.get_id())[0]
        streams_before = len(a_conn.get_streams())

        async def send(protocol: str, payload: bytes, *, close: bool = True) -> None:
            """Misbehave; a's side may reset the stream before we are done, which is fine."""
            try:
                stream = await b.host.open_stream(a.peer_id, [protocol])
                await stream.write(payload)
                if close:
                    await stream.close()
            except Exception:
                pass

        await send("/test/raise/1", b"x")
        await send("/test/eof/1", b"x")
        await send("/test/slow/1", b"x", close=False)  # then goes silent
        await send("/test/echo/1", varint_encode(1 << 40))  # length prefix far over the limit
        await send("/test/echo/1", varint_encode(100) + b"short")  # frame cut off
        await send("/test/echo/1", b"\xff" * 12)  # varint that never ends
        await send("/meshsub/1.1.0", varint_encode(8) + b"\xff" * 8)  # garbage pubsub RPC
        await send("/ipfs/kad/1.0.0", varint_encode(6) + b"\x0a\xff\xff\xff\xff\x0f")  # garbage DHT RPC

        b_id = b.peer_id
        await wait_until(lambda: a.host.guard.errors[b_id] >= 5 and a.host.guard.timeouts[b_id] >= 1, timeout=10)

        # a still serves streams ...
        stream = await b.host.open_stream(a.peer_id, ["/test/echo/1"])
        await stream.write(frame(b"hello"))
        with trio.fail_after(5):
            assert await FrameReader(stream).read_frame(1024) == b"olleh"
        await stream.close()
        # ... and gossip, over the same connection
        sub = await a.gossip.subscribe(TOPIC_JOBS)
        await b.gossip.subscribe(TOPIC_JOBS)
        await wait_until(lambda: a.gossip.mesh_peers(TOPIC_JOBS) and b.gossip.mesh_peers(TOPIC_JOBS), timeout=10)
        await b.gossip.publish(Heartbeat(seq=1, active_shards=0, coordinating=()))
        with trio.fail_after(10):
            assert (await sub.receive()).message.seq == 1
        assert a.host.libp2p.get_network().get_connections(b.host.libp2p.get_id())[0] is a_conn
        # no stream of the misbehaviour is left open on a's side (gossip added at most its own)
        await wait_until(lambda: len(a_conn.get_streams()) <= streams_before + 1, timeout=5)


async def test_cancelling_a_read_mid_transfer_does_not_kill_the_connection():
    """py-libp2p sends Yamux window updates from inside stream reads; a read cancelled half-way
    through that write used to leave half a frame on the wire and kill the connection."""
    async with agents(2) as (a, b):
        async def flood(stream):
            for _ in range(64):
                await stream.write(b"\0" * 65536)

        async def echo(stream):
            await stream.write(await stream.read(100))

        a.host.set_handler("/test/flood/1", flood, timeout=10)
        a.host.set_handler("/test/echo-raw/1", echo, timeout=10)
        conn = b.host.libp2p.get_network().get_connections(a.host.libp2p.get_id())[0]
        for attempt in range(20):
            stream = await b.host.open_stream(a.peer_id, ["/test/flood/1"])
            with trio.move_on_after(0.002 * (attempt + 1)):
                try:
                    while True:
                        await stream.read(1 << 20)
                except StreamEOF:
                    pass  # a fast machine read the whole flood before the cancel came: nothing cut short
            await stream.reset()
        stream = await b.host.open_stream(a.peer_id, ["/test/echo-raw/1"])
        await stream.write(b"still alive")
        with trio.fail_after(5):
            assert await stream.read(100) == b"still alive"
        assert b.host.libp2p.get_network().get_connections(a.host.libp2p.get_id())[0] is conn


async def test_window_updates_go_back_once_half_the_window_is_read_not_after_every_read(monkeypatch):
    """py-libp2p 0.8.1 answered every read with a Yamux WINDOW_UPDATE frame (one more encrypted frame each
    way per gossip message); go-yamux's rule (agent/net/host.py) sends one once half the window is free,
    and a sender that fills the window still gets its room back."""
    from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE, YamuxStream

    updates: list[int] = []
    send_window_update = YamuxStream.send_window_update

    async def counted(self, increment, skip_lock=False):
        updates.append(increment)
        await send_window_update(self, increment, skip_lock=skip_lock)

    monkeypatch.setattr(YamuxStream, "send_window_update", counted)
    async with agents(2) as (a, b):
        small, piece = 200, b"x" * 500  # 100 kB in small reads: under half the window
        big = 4 * DEFAULT_WINDOW_SIZE  # four windows: only the receiver's updates let it through
        got = {"small": 0, "big": 0}

        async def sink(stream):
            reader = FrameReader(stream, chunk=len(piece) + 8)
            for _ in range(small):
                got["small"] += len(await reader.read_frame(1024))
            received = 0
            while received < big:
                received += len(await stream.read(65536))
            got["big"] = received
            await stream.write(b"done")

        a.host.set_handler("/test/window/1", sink, timeout=30)
        stream = await b.host.open_stream(a.peer_id, ["/test/window/1"])
        before = len(updates)
        for _ in range(small):
            await stream.write(frame(piece))
        with trio.fail_after(10):
            while got["small"] < small * len(piece):
                await trio.sleep(0.01)
        assert len(updates) == before, updates[before:]  # 200 reads, no update
        with trio.fail_after(20):
            for _ in range(big // 65536):
                await stream.write(b"\0" * 65536)
            assert await stream.read(4) == b"done"
        assert got["big"] == big and 1 <= len(updates) - before <= 16, updates[before:]
