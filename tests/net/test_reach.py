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


def test_relay_auto_serves_circuits_once_autonat_says_public_and_not_while_private():
    from dataclasses import asdict

    from agent.cli import _reach_lines

    async def main() -> None:
        async with AsyncExitStack() as stack:
            auto = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(relay="auto")))
            boot = (auto.host.addrs()[0],)
            # "auto" behind a NAT: its own address cannot be dialled back (here: announced dead)
            hidden = await stack.enter_async_context(open_network(
                Identity.generate(), NetConfig(bootstrap=boot, relay="auto", announce=(str(_free_port_addr()),))))
            a = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot)))
            b = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot)))
            auto_id, hidden_id = auto.host.libp2p.get_id(), hidden.host.libp2p.get_id()
            report = auto.host.reach.report()
            assert report.relay_mode == "auto" and not report.relay_service  # not before AutoNAT has spoken
            assert "relay = auto: serves once public" in "\n".join(_reach_lines(asdict(report)))
            # the maintain loop: peers dial it back -> public -> it serves the hop protocol, and says so
            await wait_until(lambda: auto.host.reach.status == "public" and auto.host.reach.relay_service, timeout=20)
            await wait_until(lambda: auto_id in a.host.reach.relays(), timeout=10)  # identify push told a
            assert "serving as a relay" in "\n".join(_reach_lines(asdict(auto.host.reach.report())))
            await wait_until(lambda: hidden.host.reach.status == "private", timeout=20)
            assert not hidden.host.reach.report().relay_service
            assert hidden_id not in a.host.reach.relays()
            # a real circuit through the auto relay
            assert await a.host.reach.reserve(auto_id)
            circuit = [addr for addr in a.host.addrs() if is_circuit(addr)]
            assert circuit
            with trio.fail_after(15):
                await b.host.reach.dial_relayed(PeerInfo(to_libp2p_id(a.peer_id), [multiaddr.Multiaddr(circuit[0])]))
            assert b.host.reach.report().relayed == [a.peer_id]
            assert auto.host.reach.report().circuits_served == 1
            # a private "auto" agent refuses to relay (it serves no hop protocol)
            await hidden.host.connect(PeerInfo(to_libp2p_id(a.peer_id), [multiaddr.Multiaddr(a.host.addrs()[0])]))
            assert not await a.host.reach.reserve(hidden_id)

    _run(main)


async def _forward(listeners, target: list[int]) -> None:
    """A port forward (a router's, in miniature): each connection to ``listeners`` is piped to target[0]."""
    async def pipe(src, dst) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.move_on_after(1):
                await dst.aclose()

    async def handle(inbound) -> None:
        outbound = await trio.open_tcp_stream("127.0.0.1", target[0])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipe, inbound, outbound)
            nursery.start_soon(pipe, outbound, inbound)

    await trio.serve_listeners(handle, listeners)


def test_peers_learn_and_dial_the_announced_address_not_the_listen_one():
    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        forwarded = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{listeners[0].socket.getsockname()[1]}")
        target: list[int] = []
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            agent = await stack.enter_async_context(open_network(Identity.generate(),
                                                                 NetConfig(announce=(str(forwarded),))))
            listen = agent.host.libp2p.get_network().listeners
            target.append(int(next(iter(listen.values())).get_addrs()[0].value_for_protocol("tcp")))
            nursery.start_soon(_forward, listeners, target)
            listen_addr = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{target[0]}")
            assert listen_addr != forwarded
            # what the agent tells everyone: the announced address only
            assert agent.host.addrs() == [f"{forwarded}/p2p/{agent.peer_id}"]
            peer = await stack.enter_async_context(open_network(
                Identity.generate(), NetConfig(bootstrap=(agent.host.addrs()[0],))))
            agent_id = agent.host.libp2p.get_id()
            assert agent_id in peer.host.libp2p.get_connected_peers()  # it dialled the forwarded port
            # identify: the peer stores the announced address, never the listen one
            def stored() -> set[str]:
                return {str(a).split("/p2p/")[0] for a in peer.host.libp2p.get_peerstore().addrs(agent_id)}

            await wait_until(lambda: str(forwarded) in stored(), timeout=10)
            assert str(listen_addr) not in stored(), stored()
            # the DHT hands it on: a third peer that knows only `peer` finds and dials the announced address
            third = await stack.enter_async_context(open_network(
                Identity.generate(), NetConfig(bootstrap=(peer.host.addrs()[0],))))
            with trio.fail_after(15):
                found = await third.discovery.find_peer(agent.peer_id)
            assert found is not None
            found_addrs = {str(a).split("/p2p/")[0] for a in found.addrs}
            assert str(forwarded) in found_addrs and str(listen_addr) not in found_addrs, found_addrs
            await third.host.connect(found, timeout=10)
            # AutoNAT: the peers dial the announced address back through the forward: public
            with trio.fail_after(20):
                assert await agent.host.reach.check() == "public"
            nursery.cancel_scope.cancel()

    _run(main)


def test_relay_auto_stops_serving_when_it_becomes_private_and_drops_the_slots_it_granted(monkeypatch):
    # py-libp2p keeps the verdicts of AutoNAT servers no longer asked: two old successes kept an
    # "auto" relay public for ever after its address stopped being dialable. And the slots it granted
    # outlived its serving, so clients went on advertising circuits through it.
    from agent.net import reach

    monkeypatch.setattr(reach, "FIRST_CHECKS", 0.5)
    monkeypatch.setattr(reach, "CHECK_INTERVAL", 1.0)

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        forwarded = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{listeners[0].socket.getsockname()[1]}")
        target: list[int] = []
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            # "auto", public through a port forward (its announced address) while the forward lives
            auto = await stack.enter_async_context(open_network(
                Identity.generate(), NetConfig(relay="auto", announce=(str(forwarded),))))
            listen = auto.host.libp2p.get_network().listeners
            target.append(int(next(iter(listen.values())).get_addrs()[0].value_for_protocol("tcp")))
            forward = trio.CancelScope()

            async def run_forward() -> None:
                with forward:
                    await _forward(listeners, target)

            nursery.start_soon(run_forward)
            # the peers reach it at its listen address: the forward only carries AutoNAT's dial-backs
            boot = (f"/ip4/127.0.0.1/tcp/{target[0]}/p2p/{auto.peer_id}",)
            client = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot)))
            early = await stack.enter_async_context(AsyncExitStack())  # the last entered: closed first
            early_ids = [(await early.enter_async_context(open_network(
                Identity.generate(), NetConfig(bootstrap=boot)))).host.libp2p.get_id() for _ in range(2)]
            auto_id, client_id = auto.host.libp2p.get_id(), client.host.libp2p.get_id()
            # both peers that will leave have dialled it back (two successes: CONFIRMATIONS)
            await wait_until(lambda: auto.host.reach.status == "public" and auto.host.reach.relay_service
                             and all(auto.host.reach.autonat.dial_results.get(p) for p in early_ids), timeout=20)
            await wait_until(lambda: auto_id in client.host.reach.relays(), timeout=10)
            assert await client.host.reach.reserve(auto_id)
            slots = auto.host.reach.protocol.resource_manager
            assert slots.has_reservation(client_id)
            # the network changes: the forward is gone, the peers that said "public" leave, a new one comes
            forward.cancel()
            for listener in listeners:
                await listener.aclose()
            await early.aclose()
            await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot)))
            await wait_until(lambda: auto.host.reach.status == "private" and not auto.host.reach.relay_service,
                             timeout=20)
            assert not auto.host.reach.report().relay_service
            assert not slots.has_reservation(client_id) and client_id not in slots._reservations
            assert not await client.host.reach.reserve(auto_id)  # refused: it serves no hop protocol now
            nursery.cancel_scope.cancel()

    _run(main)
