"""A peer that was down for a moment is dialled again as soon as we ask (py-libp2p's negative cache).

py-libp2p 0.8.1 refuses for 60 s to dial a peer one of whose dials failed. In the 30-minute soak a
worker restarted within 5 s was unreachable, for a minute, from every peer that had tried it while it
was down (203 refusals: "recently failed all addresses (negative cache)"). ``Host.connect`` and
``Host.open_stream`` forget that failure: our callers retry on their own deadlines.
"""

import socket

import pytest
import trio

from agent.net.host import Host, NetConfig, NetError
from protocol.identity import Identity

pytestmark = pytest.mark.network


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_restarted_peer_is_dialled_again_at_once():
    port = _free_port()
    server_identity = Identity.generate()

    async def echo(stream):
        await stream.write(await stream.read(16))
        await stream.close()

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        server = Host(server_identity, NetConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",)))
        async with server.run():
            server.set_handler("/test/echo/1", echo, timeout=5)
            task_status.started(server.addrs()[0])
            await trio.sleep_forever()

    async def ask(client: Host) -> bytes:
        stream = await client.open_stream(server_identity.peer_id, ["/test/echo/1"], timeout=5)
        with trio.fail_after(5):
            await stream.write(b"ping")
            answer = await stream.read(16)
        await stream.close()
        return answer

    client = Host(Identity.generate(), NetConfig(listen=("/ip4/127.0.0.1/tcp/0",)))
    async with client.run(), trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def serve_once(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await serve(task_status=task_status)

        from agent.net.host import parse_peer_multiaddr

        address = await nursery.start(serve_once)
        await client.connect(parse_peer_multiaddr(address, "server"))
        assert await ask(client) == b"ping"
        scope.cancel()  # the peer goes down ...
        with trio.fail_after(10):
            while server_identity.peer_id in client.connected_peers():
                await trio.sleep(0.05)
        with pytest.raises(NetError):  # ... a dial fails meanwhile (py-libp2p remembers it for 60 s) ...
            await ask(client)
        scope = trio.CancelScope()
        await nursery.start(serve_once)  # ... and it is back within seconds, on the same port
        assert await ask(client) == b"ping"  # before: "recently failed all addresses (negative cache)"
        scope.cancel()


async def test_a_stream_opens_in_one_round_trip_and_a_refused_protocol_still_moves_on(monkeypatch):
    """The multistream-select header and our proposal go out together (PipelinedMultiselectClient): the
    client writes twice before it reads, so a stream costs one round trip, not two; a refused proposal
    (``na``) still moves on to the next protocol offered, on the same stream."""
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

    from tests.net.conftest import agents

    ops: dict[int, list[str]] = {}  # communicator -> its operations in order (both ends run in this process)
    write, read = MultiselectCommunicator.write, MultiselectCommunicator.read

    async def spy_write(self, msg_str):
        ops.setdefault(id(self), []).append("w")
        return await write(self, msg_str)

    async def spy_read(self):
        ops.setdefault(id(self), []).append("r")
        return await read(self)

    async def echo(stream):
        await stream.write(await stream.read(5))
        await stream.close()

    from agent.net.host import PipelinedMultiselectClient

    ours: list[int] = []  # the communicators of the streams this test opens
    select = PipelinedMultiselectClient.select_one_of

    async def spy_select(self, protocols, communicator, *args):
        if "/infernet/test-echo/1.0.0" in protocols:
            ours.append(id(communicator))
        return await select(self, protocols, communicator, *args)

    monkeypatch.setattr(PipelinedMultiselectClient, "select_one_of", spy_select)

    def initiator() -> list[str]:
        return ops[ours[-1]]

    async with agents(2) as (a, b):
        b.host.set_handler("/infernet/test-echo/1.0.0", echo, timeout=10)
        with trio.fail_after(20):
            while b.peer_id not in a.host.connected_peers():
                await trio.sleep(0.05)
            monkeypatch.setattr(MultiselectCommunicator, "write", spy_write)
            monkeypatch.setattr(MultiselectCommunicator, "read", spy_read)
            stream = await a.host.open_stream(b.peer_id, ["/infernet/test-echo/1.0.0"])
            await stream.write(b"hello")
            assert await stream.read(5) == b"hello"
            await stream.close()
            assert initiator() == ["w", "w", "r", "r"]  # header and proposal, then both answers
            ops.clear()
            stream = await a.host.open_stream(b.peer_id, ["/infernet/absent/1.0.0", "/infernet/test-echo/1.0.0"])
            await stream.write(b"again")
            assert await stream.read(5) == b"again"
            await stream.close()
            assert initiator() == ["w", "w", "r", "r", "w", "r"]  # refused ("na"), then the next one
