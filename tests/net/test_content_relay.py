"""IPIP-0003 §4.1 on real loopback hosts: direct providers first, relay-only providers last, and never
a file over a circuit's byte limit through a relay.

The provider "behind a NAT" is a real agent whose announced address is dead (nobody listens there),
as a NATed agent's own address is to the outside: it is reached only through its slot on a real
circuit relay v2 (an agent with ``relay = true``).
"""

from __future__ import annotations

import os
import socket
from contextlib import AsyncExitStack

import pytest
import trio

from agent.content.errors import FetchError
from agent.content.service import open_content
from agent.net.errors import NetError
from agent.net.host import NetConfig, to_libp2p_id
from agent.net.stack import open_network
from protocol.identity import Identity
from tests.net.conftest import wait_until

pytestmark = pytest.mark.network


def _dead_addr() -> str:
    with socket.socket() as s:  # bound, then closed: nobody listens there
        s.bind(("127.0.0.1", 0))
        return f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"


async def _setup(stack: AsyncExitStack, tmp_path):
    """A relay, a provider reachable only through it, a directly reachable provider, a fetcher."""
    relay = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(relay=True)))
    boot = (relay.host.addrs()[0],)
    dead = _dead_addr()
    nated = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot, announce=(dead,))))
    direct = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot)))
    fetcher = await stack.enter_async_context(open_network(Identity.generate(), NetConfig(bootstrap=boot)))
    rooms = [await stack.enter_async_context(open_content(n.host, n.discovery, tmp_path / name, idle_timeout=5.0))
             for name, n in (("nated", nated), ("direct", direct), ("fetcher", fetcher))]
    relay_id = relay.host.libp2p.get_id()
    await wait_until(lambda: relay_id in nated.host.reach.relays() and relay_id in fetcher.host.reach.relays(),
                     timeout=10)
    assert await nated.host.reach.reserve(relay_id)
    return relay, nated, direct, fetcher, rooms, f"{dead}/p2p/{nated.peer_id}"


async def test_relay_only_providers_come_last_and_never_carry_a_file_over_the_circuit_limit(tmp_path):
    async with AsyncExitStack() as stack:
        relay, nated, direct, fetcher, (nated_room, direct_room, room), nated_addr = await _setup(stack, tmp_path)
        small = os.urandom(300_000)
        root = await nated_room.add_bytes(small, provide=False)
        assert await direct_room.add_bytes(small, provide=False) == root
        direct_addr = direct.host.addrs()[0]

        # 1. the relay-only provider is named first; the direct one serves the whole file
        with trio.fail_after(30):
            report = await room.fetch(root, tmp_path / "out" / "a.bin", providers=[nated_addr, direct_addr],
                                      use_dht=False, exact_size=len(small))
        assert report.providers_used == [direct.peer_id]
        assert relay.host.reach.report().circuits_served == 0  # the relay carried nothing

        # 2. a file within the circuit's limit, held only behind the relay, comes through it
        other = os.urandom(200_000)
        other_root = await nated_room.add_bytes(other, provide=False)
        with trio.fail_after(30):
            report = await room.fetch(other_root, tmp_path / "out" / "b.bin", providers=[nated_addr],
                                      use_dht=False, exact_size=len(other))
        assert report.providers_used == [nated.peer_id] and (tmp_path / "out" / "b.bin").read_bytes() == other
        assert relay.host.reach.report().circuits_served == 1
        assert fetcher.host.reach.report().relayed == [nated.peer_id]

        # 3. over the limit, connected through the relay already: skipped with a one-line reason naming
        #    the CID and the limit, not one block asked for
        room.relay_data_limit = 250_000
        big = os.urandom(400_000)
        big_root = await nated_room.add_bytes(big, provide=False)
        with trio.fail_after(30), pytest.raises(FetchError) as caught:
            await room.fetch(big_root, tmp_path / "out" / "c.bin", providers=[nated_addr], use_dht=False,
                             exact_size=len(big))
        message = str(caught.value)
        assert "\n" not in message and str(big_root) in message and "250000" in message
        assert "only through a relay" in message
        assert room.store.get(big_root) is None and not (tmp_path / "out" / "c.bin").exists()

        # 4. the same file from a direct provider too: that one serves it, the relay-only one is skipped
        assert await direct_room.add_bytes(big, provide=False) == big_root
        with trio.fail_after(30):
            report = await room.fetch(big_root, tmp_path / "out" / "d.bin", providers=[nated_addr, direct_addr],
                                      use_dht=False, exact_size=len(big))
        assert report.providers_used == [direct.peer_id]


async def test_a_provider_not_yet_connected_is_not_asked_through_a_relay_for_a_file_over_the_limit(tmp_path):
    # The bug of IPIP-0003 §4.1 rule 3: a provider not connected yet was dialled with the relay
    # fallback and then asked for the whole file over the circuit, whatever its size.
    async with AsyncExitStack() as stack:
        relay, nated, _direct, fetcher, (nated_room, _, room), nated_addr = await _setup(stack, tmp_path)
        room.relay_data_limit = 100_000
        data = os.urandom(300_000)
        root = await nated_room.add_bytes(data, provide=False)
        with trio.fail_after(30), pytest.raises(FetchError) as caught:
            await room.fetch(root, tmp_path / "out.bin", providers=[nated_addr], use_dht=False, exact_size=len(data))
        message = str(caught.value)
        assert str(root) in message and "100000" in message and "only through a relay" in message
        assert room.store.get(root) is None
        # its dead direct address failed; no circuit was opened for a file the circuit could not carry
        assert fetcher.host.reach.report().relayed == []
        assert relay.host.reach.report().circuits_served == 0


async def test_the_relay_only_reason_is_given_only_when_no_provider_was_reached(tmp_path):
    # A direct provider that was reached but lacks the file is the real reason, not "no provider
    # could be reached directly" (which used to replace it whenever a relay-only one was skipped).
    async with AsyncExitStack() as stack:
        _relay, _nated, direct, _fetcher, (nated_room, _, room), nated_addr = await _setup(stack, tmp_path)
        room.relay_data_limit = 100_000
        data = os.urandom(300_000)
        root = await nated_room.add_bytes(data, provide=False)
        with trio.fail_after(30), pytest.raises(FetchError) as caught:
            await room.fetch(root, tmp_path / "out.bin", providers=[nated_addr, direct.host.addrs()[0]],
                             use_dht=False, exact_size=len(data))
        message = str(caught.value)
        assert "\n" not in message and "could be reached directly" not in message, message
        assert "no source could supply the rest" in message
        assert f"{direct.peer_id}: lacks block" in message and "only through a relay" in message


async def test_a_direct_only_dial_leaves_half_the_time_to_the_relay_when_one_is_known(tmp_path):
    # Phase 1 of a fetch dials a provider's own addresses only (relay=False); a NATed provider's
    # announced address may swallow the dial (here: a listener that never answers the handshake), and
    # its relay dial comes after, so the direct dial gets half the deadline, not all of it.
    import multiaddr
    from libp2p.peer.peerinfo import PeerInfo

    async with AsyncExitStack() as stack:
        _relay, _nated, _direct, fetcher, _rooms, _ = await _setup(stack, tmp_path)
        silent = stack.enter_context(socket.socket())
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the TCP handshake; nobody ever speaks
        addr = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}")
        start = trio.current_time()
        with pytest.raises(NetError) as caught:
            await fetcher.host.connect(PeerInfo(to_libp2p_id(Identity.generate().peer_id), [addr]), timeout=8,
                                       relay=False)
        assert "no connection within 4 s" in str(caught.value)
        assert trio.current_time() - start < 6.5
        assert fetcher.host.reach.report().relayed == []


@pytest.fixture(scope="module")
def tiny_model_dir():
    from agent.train.tiny import tiny_model

    return tiny_model()


async def test_a_worker_provides_the_shard_it_fetched_and_verified(tmp_path, tiny_model_dir):
    # rule 1: later fetches of a shard (a reassigned attempt, a replay) find the worker that holds it,
    # not only the submitter (who may sit behind a NAT)
    from protocol import state as st
    from protocol.cid import parse_cid
    from tests.roles.conftest import fast_spec, network, write_dataset

    dataset = write_dataset(tmp_path / "demo.jsonl", 80)
    spec = fast_spec(shards=2, rounds=1, max_steps=4)
    async with network(tmp_path, tiny_model_dir, workers=2) as net:
        submitter = net.submitter
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        view = await submitter.submitter.announce(terms)
        await submitter.wait_for(lambda: view.state.terminal, timeout=180)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        trained = {s.index: s.worker for s in view.state.shards}
        assert all(trained.values()) and submitter.peer_id not in trained.values()
        for ref in terms.shards:
            async def provided(cid=ref.cid) -> set[str]:
                infos = await submitter.net.discovery.find_providers(parse_cid(cid), timeout=5)
                return {i.peer_id.to_base58() for i in infos}

            with trio.fail_after(30):
                while trained[ref.index] not in await provided():
                    await trio.sleep(0.2)
