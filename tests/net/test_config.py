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
