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
