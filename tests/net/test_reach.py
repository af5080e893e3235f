"""Reachability on loopback: AutoNAT's dial-back proves an address, circuit relay v2 carries a connection."""

from __future__ import annotations

from contextlib import AsyncExitStack

import multiaddr
import trio
from libp2p.host.ping import ID as PING
from libp2p.peer.peerinfo import PeerInfo

from agent.content.exchange import first_error
from agent.net.host import NetConfig, to_libp2p_id
from agent.net.stack import open_network
from agent.net.reach import _dial_back, is_circuit
from protocol.identity import Identity
from tests.net.conftest import wait_until


def _run(main) -> None:
    try:
        trio.run(main)
    except BaseExceptionGroup as group:  # py-libp2p's nested nurseries: report the one cause
        raise first_error(group) from None


def _free_port_addr() -> multiaddr.Multiaddr:
    import socket

    with socket.socket() as s:  # bound, then closed: nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")


def test_autonat_dials_back_on_a_fresh_connection_not_the_one_it_was_asked_on():
    async def main() -> None:
        async with open_network(Identity.generate()) as a, \
                open_network(Identity.generate(), NetConfig(bootstrap=(a.host.addrs()[0],))) as b:
            assert a.host.libp2p.get_id() in b.host.libp2p.get_connected_peers()
            live = multiaddr.Multiaddr(a.host.addrs()[0].split("/p2p/")[0])
            dead = _free_port_addr()
            assert await _dial_back(live) and not await _dial_back(dead)
            server = b.host.reach.autonat
            a_id = a.host.libp2p.get_id()
            # py-libp2p's own dial-back would call host.connect, which succeeds at once for a connected
            # peer whatever the address: ours finds nobody at the dead address
            assert await server._try_dial(a_id, [dead.to_bytes()]) is None
            assert await server._try_dial(a_id, [live.to_bytes()]) == live.to_bytes()
            assert await a.host.reach.check() == "public"  # b dialled a back at its real address

    _run(main)


def test_a_relay_carries_a_connection_that_outlives_its_handshake():
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(relay=True)))
            config = NetConfig(bootstrap=(relay.host.addrs()[0],))
            a = await stack.enter_async_context(open_network(Identity.generate(), config))
            b = await stack.enter_async_context(open_network(Identity.generate(), config))
            relay_id = relay.host.libp2p.get_id()
            await wait_until(lambda: relay_id in a.host.reach.relays(), timeout=10)
            assert await a.host.reach.reserve(relay_id)
            circuit = [addr for addr in a.host.addrs() if is_circuit(addr)]
            assert circuit and circuit[0].endswith(f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{a.peer_id}")
            a_id = to_libp2p_id(a.peer_id)
            assert a_id not in b.host.libp2p.get_connected_peers()
            with trio.fail_after(15):
                await b.host.reach.dial_relayed(PeerInfo(a_id, [multiaddr.Multiaddr(circuit[0])]))
            assert b.host.reach.report().relayed == [a.peer_id]
            await trio.sleep(1.5)  # the destination's handler used to return here, closing the circuit
            with trio.fail_after(10):
                stream = await b.host.libp2p.new_stream(a_id, [PING])
                await stream.write(b"p" * 32)
                assert await stream.read(32) == b"p" * 32
                await stream.close()
            assert relay.host.reach.report().circuits_served == 1
            assert a.host.reach.report().reservations.keys() == {relay.peer_id}

    _run(main)
