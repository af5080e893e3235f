"""Hole punching (DCUtR) between two agents behind two harness NAT routers, through a public relay."""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict

import multiaddr
import pytest
import trio
from libp2p.host.ping import ID as PING
from libp2p.peer.peerinfo import PeerInfo

from agent.cli import _reach_lines
from agent.content.exchange import first_error
from agent.harness.hosts import Entered, Hosts, HostSpec, unavailable_reason
from agent.net.host import NetConfig, to_libp2p_id
from agent.net.stack import open_network
from agent.net.reach import _conns, _is_relayed_conn, is_circuit
from protocol.identity import Identity

needs_hosts = pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"no harness hosts here: {unavailable_reason()}")


def _in_namespace(ns: str, main, results: dict, name: str) -> threading.Thread:
    """Run ``trio.run(main)`` on a thread inside network namespace ``ns``; its outcome lands in results."""

    def body() -> None:
        entered = Entered(ns)
        try:
            results[name] = trio.run(main)
        except BaseExceptionGroup as group:
            results[name] = first_error(group)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            results[name] = exc
        finally:
            entered.leave()

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


async def _get(q: queue.Queue, timeout: float):
    with trio.fail_after(timeout):
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                await trio.sleep(0.05)


@needs_hosts
def test_two_nated_agents_upgrade_their_relayed_connection_to_a_direct_one():
    hosts = Hosts({"hub": HostSpec("hub"), "home1": HostSpec("home1", nat=True),
                   "home2": HostSpec("home2", nat=True)}).create()
    try:
        relay_addr: queue.Queue = queue.Queue()
        a_addr: queue.Queue = queue.Queue()
        done = threading.Event()
        results: dict = {}

        async def relay_main():
            config = NetConfig(listen=(f"/ip4/{hosts.ip('hub')}/tcp/4001",), relay=True)
            async with open_network(Identity.generate(), config) as relay:
                relay_addr.put(relay.host.addrs()[0])
                relay_addr.put(relay.host.addrs()[0])
                with trio.fail_after(60):
                    while not done.is_set():
                        await trio.sleep(0.1)
                return relay.host.reach.report()

        async def a_main():
            boot = await _get(relay_addr, 10)
            config = NetConfig(listen=(f"/ip4/{hosts.ip('home1')}/tcp/4001",), bootstrap=(boot,))
            async with open_network(Identity.generate(), config) as a:
                with trio.fail_after(20):
                    while not a.host.reach.reservations:
                        await trio.sleep(0.1)
                a_addr.put([x for x in a.host.addrs() if is_circuit(x)][0])
                with trio.fail_after(60):
                    while not done.is_set():
                        await trio.sleep(0.1)
                with trio.move_on_after(10):  # its side of the punch ends when it sees the direct connection
                    while not a.host.reach.report().hole_punched:
                        await trio.sleep(0.1)
                return a.host.reach.report()

        async def b_main():
            boot = await _get(relay_addr, 10)
            config = NetConfig(listen=(f"/ip4/{hosts.ip('home2')}/tcp/4001",), bootstrap=(boot,))
            async with open_network(Identity.generate(), config) as b:
                circuit = await _get(a_addr, 30)
                a_id = to_libp2p_id(circuit.split("/p2p/")[-1])
                with trio.fail_after(15):
                    await b.host.reach.dial_relayed(PeerInfo(a_id, [multiaddr.Multiaddr(circuit)]))
                first = b.host.reach.report()
                a_peer = a_id.to_base58()
                with trio.move_on_after(20):  # a drives DCUtR (it received the relayed connection) within ~2 s
                    while a_peer not in b.host.reach.report().direct:
                        await trio.sleep(0.1)
                direct = [c for c in _conns(b.host.libp2p, a_id) if not _is_relayed_conn(c)]
                remote = [str(addr) for c in direct for addr in c.get_transport_addresses()]
                with trio.fail_after(10):  # the direct connection carries streams
                    stream = await b.host.libp2p.new_stream(a_id, [PING])
                    await stream.write(b"p" * 32)
                    echoed = await stream.read(32)
                    await stream.close()
                done.set()
                with trio.move_on_after(10):  # its side of the punch ends when it sees the direct connection
                    while not b.host.reach.report().hole_punched:
                        await trio.sleep(0.1)
                return first, b.host.reach.report(), remote, echoed

        threads = [_in_namespace(hosts.ns(n), m, results, n)
                   for n, m in (("hub", relay_main), ("home1", a_main), ("home2", b_main))]
        for t in threads:
            t.join(90)
        for name, value in results.items():
            if isinstance(value, BaseException):
                raise value
        first, last, remote, echoed = results["home2"]
        a_peer = results["home1"].relayed_addrs[0].split("/p2p/")[-1]
        assert a_peer in first.relayed and a_peer not in first.direct, first  # the relay carried it first
        assert a_peer in last.direct, last  # then a direct connection
        # through both NATs: b reached a at a's router (its predicted address: NAT IP, a's listen port)
        assert f"/ip4/{hosts.public['home1']}/tcp/4001" in remote, remote
        assert echoed == b"p" * 32
        assert last.hole_punched == 1 and results["home1"].hole_punched == 1, (last, results["home1"])
        assert results["hub"].circuits_served == 1
        assert "1 upgraded to direct by hole punching" in "\n".join(_reach_lines(asdict(last)))
    finally:
        hosts.close()


def test_hole_punch_dials_skip_addresses_that_reach_ourselves():
    from agent.net.reach import _routable

    assert not _routable(multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4001"))  # a listen address, advertised as is
    assert not _routable(multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001"))
    assert not _routable(multiaddr.Multiaddr("/ip6/::/tcp/4001"))
    assert _routable(multiaddr.Multiaddr("/ip4/10.1.0.102/tcp/4001"))  # a NAT's address
    assert _routable(multiaddr.Multiaddr("/ip4/192.168.1.2/tcp/4001"))  # a LAN peer may answer there
