"""Network settings: a bad address is one clear line naming the field and the text."""

import pytest

from agent.net.errors import NetConfigError
from agent.net.host import Host, NetConfig
from protocol.identity import Identity


@pytest.mark.parametrize("config, message", [
    (NetConfig(bootstrap=("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
                          "/ip4/1.2.3.4/tcp/notaport/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN")),
     "bootstrap[1]: '/ip4/1.2.3.4/tcp/notaport/p2p/"),
    (NetConfig(bootstrap=("/ip4/127.0.0.1/tcp/4001",)), "bootstrap[0]: '/ip4/127.0.0.1/tcp/4001': needs a trailing /p2p/"),
    (NetConfig(bootstrap=("127.0.0.1:4001",)), "bootstrap[0]: '127.0.0.1:4001': invalid multiaddr"),
    (NetConfig(listen=("/ip4/999.0.0.1/tcp/0",)), "listen[0]: '/ip4/999.0.0.1/tcp/0': invalid multiaddr"),
    (NetConfig(listen=()), "listen: at least one"),
])
def test_bad_addresses_are_named(config, message):
    with pytest.raises(NetConfigError) as failure:
        Host(Identity.generate(), config)
    assert str(failure.value).startswith(message)
    assert "\n" not in str(failure.value)


async def test_a_listen_port_another_agent_holds_is_refused_at_start():
    """Issue 21 (4): py-libp2p listens with SO_REUSEPORT (hole punching dials from the listen port), so a
    second agent on a taken port used to start, log 'ready', and share the port with the first."""
    import socket

    from agent.net.errors import NetError
    from agent.net.stack import open_network

    async with open_network(Identity.generate()) as first:
        port = int(first.host.addrs()[0].split("/tcp/")[1].split("/")[0])
        taken = f"/ip4/127.0.0.1/tcp/{port}"
        with pytest.raises(NetError) as failure:
            async with open_network(Identity.generate(), NetConfig(listen=(taken,))):
                pass
        assert str(failure.value).startswith(f"listen: {taken} is in use") and "\n" not in str(failure.value)
    with socket.socket() as free:  # and a port nobody holds any more is taken again at once
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    async with open_network(Identity.generate(), NetConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",))) as net:
        assert f"/tcp/{port}/" in net.host.addrs()[0]


async def test_a_restarted_bootstrap_peer_is_dialled_again():
    """Issue 21 (5), found by the soak: a submitter restarted after kill -9 is everyone's bootstrap peer
    and has no bootstrap list of its own, so it heard nobody until someone dialled it (60 s; its job
    failed meanwhile). ``Discovery.maintain`` now dials lost bootstrap peers again every round."""
    import socket

    import trio

    from agent.net.stack import open_network

    identity = Identity.generate()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = NetConfig(listen=(f"/ip4/127.0.0.1/tcp/{port}",))

    async def bootstrap_peer(up: trio.Event, stop: trio.Event, out: list) -> None:
        async with open_network(identity, listen) as net:
            out.append(net.host.addrs()[0])
            up.set()
            await stop.wait()

    async with trio.open_nursery() as nursery:
        up, stop, addrs = trio.Event(), trio.Event(), []
        nursery.start_soon(bootstrap_peer, up, stop, addrs)
        await up.wait()
        async with open_network(Identity.generate(), NetConfig(bootstrap=(addrs[0],))) as other:
            assert identity.peer_id in other.host.connected_peers()
            stop.set()  # the bootstrap peer goes away...
            with trio.fail_after(10):
                while identity.peer_id in other.host.connected_peers():
                    await trio.sleep(0.1)
            up, stop = trio.Event(), trio.Event()
            nursery.start_soon(bootstrap_peer, up, stop, addrs)  # ... and comes back on its address
            await up.wait()
            with trio.fail_after(20):
                while identity.peer_id not in await other.discovery.redial_bootstrap(timeout=5):
                    await trio.sleep(0.5)
            assert identity.peer_id in other.host.connected_peers()
            stop.set()
