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
