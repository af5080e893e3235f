"""Discovery through the DHT and signed gossip among real agents on loopback.

Six agents start from one bootstrap address, find the training agents through the DHT's workers
key, and gossip. A misbehaving agent (its own validator removed, so its py-libp2p publishes raw
bytes) sends forged, tampered, replayed, expired, oversize and misplaced messages: none reaches
anyone, each is counted against it, and no honest agent is ever blamed for forwarding one.
"""

import time
from functools import partial

import msgpack
import pytest
import trio

from agent.net.discovery import WORKERS_KEY, dht_key
from agent.net.gossip import GossipConfig
from libp2p.peer.id import ID
from protocol.codec import canonical_encode, decode_canonical
from protocol.envelope import MAX_ENVELOPE_BYTES, seal
from protocol.identity import Identity
from protocol.messages import TOPIC_JOBS, Heartbeat, JobCancel, ShardClaim
from tests.net.conftest import agents, wait_until

pytestmark = pytest.mark.network


def heartbeat(seq: int) -> Heartbeat:
    return Heartbeat(seq=seq, active_shards=0, coordinating=())


async def drain(sub, seconds: float) -> list:
    """Everything ``sub`` receives within ``seconds``."""
    got = []
    with trio.move_on_after(seconds):
        while True:
            got.append(await sub.receive())
    return got


def waiting(sub) -> list:
    """Everything already queued on ``sub``."""
    got = []
    while True:
        try:
            got.append(sub.receive_nowait())
        except trio.WouldBlock:
            return got


async def mesh_ready(nets, topic: str, timeout: float = 15.0) -> None:
    """Every agent knows at least one subscriber of ``topic`` and has it in its mesh."""
    await wait_until(lambda: all(n.gossip.mesh_peers(topic) for n in nets), timeout=timeout)


async def test_six_agents_find_each_other_through_the_dht_and_gossip_reaches_all():
    async with agents(6) as nets:
        workers = nets[1:]  # nets[0] is the bootstrap peer
        # the workers know only the bootstrap address; they advertise under the workers key
        async with trio.open_nursery() as nursery:
            for net in workers:
                nursery.start_soon(net.discovery.advertise_worker)
        everyone = {n.peer_id for n in workers}
        for net in nets:
            with trio.fail_after(20):
                found = set(await net.discovery.find_workers())
            assert found == everyone - {net.peer_id}, f"{net.peer_id} found {len(found)} workers"
            assert everyone - {net.peer_id} <= set(net.host.connected_peers())

        subs = [await n.gossip.subscribe(TOPIC_JOBS) for n in nets]
        await mesh_ready(nets, TOPIC_JOBS)
        sender = nets[3]
        await sender.gossip.publish(heartbeat(42))
        for net, sub in zip(nets, subs):
            with trio.fail_after(10):
                got = await sub.receive()
            assert got.message == heartbeat(42)
            assert got.signer == sender.peer_id
        assert all(not n.gossip.invalid for n in nets)


async def test_a_new_agent_finds_running_workers_knowing_only_the_bootstrap():
    async with agents(4) as nets:
        for net in nets[1:3]:
            await net.discovery.advertise_worker()
        newcomer = nets[3]  # never advertised, never listed by anyone
        with trio.fail_after(20):
            found = set(await newcomer.discovery.find_workers())
        assert found == {nets[1].peer_id, nets[2].peer_id}


async def test_maintenance_keeps_advertising_and_dialing_new_workers():
    async with agents(4) as nets:
        for net in nets[1:3]:
            net.host.nursery.start_soon(partial(net.discovery.maintain, advertise=True, interval=0.5))
        newcomer = nets[3]
        newcomer.host.nursery.start_soon(partial(newcomer.discovery.maintain, advertise=False, interval=0.5))
        workers = {nets[1].peer_id, nets[2].peer_id}
        await wait_until(lambda: workers <= set(newcomer.host.connected_peers())
                         and workers <= {p.peer_id.to_base58() for p in newcomer.discovery.dht.provider_store.get_providers(
                             dht_key(WORKERS_KEY))}, timeout=20)


async def test_invalid_messages_reach_no_one_and_count_against_the_sender():
    async with agents(6) as nets:
        honest, bad = nets[:5], nets[5]
        subs = [await n.gossip.subscribe(TOPIC_JOBS) for n in honest]
        await bad.gossip.subscribe(TOPIC_JOBS)
        async with trio.open_nursery() as nursery:
            for net in nets:
                nursery.start_soon(net.discovery.advertise_worker)
        async with trio.open_nursery() as nursery:
            for net in nets:
                nursery.start_soon(net.discovery.find_workers)
        await mesh_ready(nets, TOPIC_JOBS)
        await wait_until(lambda: bad.peer_id in set().union(*(n.gossip.mesh_peers(TOPIC_JOBS) for n in honest)),
                         timeout=10)
        # the misbehaving agent publishes raw bytes: remove its own validator
        bad.gossip.pubsub.remove_topic_validator(TOPIC_JOBS)
        raw_publish = bad.gossip.pubsub.publish
        now = time.time()

        first = seal(bad.host.identity, heartbeat(1), now=now)
        tampered = decode_canonical(seal(bad.host.identity, heartbeat(3), now=now), max_bytes=MAX_ENVELOPE_BYTES)
        tampered["b"]["seq"] = 4  # the body changed after signing
        claim = ShardClaim(job_id=bytes(32), round=0, shard=0)
        oversize = msgpack.packb({"v": 1, "pad": b"\0" * MAX_ENVELOPE_BYTES})
        bad_messages = {
            "replayed": first,
            "wrong-signer": seal(Identity.generate(), heartbeat(2), now=now),  # forged: not the sender's key
            "bad-signature": canonical_encode(tampered),
            "oversize": oversize,
            "expired": seal(bad.host.identity, heartbeat(5), now=now - 3600),
            "wrong-topic": seal(bad.host.identity, claim, now=now),
            "malformed": b"\xc1not msgpack",
        }
        await raw_publish(TOPIC_JOBS, first)  # valid: delivered once
        for data in bad_messages.values():
            await raw_publish(TOPIC_JOBS, data)
        await raw_publish(TOPIC_JOBS, seal(bad.host.identity, heartbeat(99), now=time.time()))

        delivered = []
        for sub in subs:
            got = []
            with trio.fail_after(10):
                while 99 not in {r.message.seq for r in got}:
                    got.append(await sub.receive())
            delivered.append(got)
        await trio.sleep(1.5)  # time for anything that raced behind the marker
        for sub, got in zip(subs, delivered):
            got += waiting(sub)
            assert sorted(r.message.seq for r in got) == [1, 99]
        blamed = sum(n.gossip.invalid[bad.peer_id] for n in honest)
        # all but the expired and replayed ones (caches and relays hand those on in good faith: IPIP-0001 §4)
        assert blamed >= len(bad_messages) - 2
        reasons = sum((n.gossip.reasons for n in honest), start=type(honest[0].gossip.reasons)())
        assert set(bad_messages) <= set(reasons), reasons
        for net in honest:  # no honest agent ever forwarded an invalid message
            assert all(net.gossip.invalid[other.peer_id] == 0 for other in honest)


async def test_our_own_bursts_arrive_whole():
    async with agents(2) as (a, b):
        sub_a = await a.gossip.subscribe(TOPIC_JOBS)
        sub_b = await b.gossip.subscribe(TOPIC_JOBS)
        await mesh_ready([a, b], TOPIC_JOBS)
        # py-libp2p's defaults would drop most of these: spam protection above 10 msg/s per topic
        # (own publishes included), a 32-slot subscription channel, a 32-slot outbound queue
        for seq in range(150):
            await a.gossip.publish(heartbeat(seq))
        assert sorted(r.message.seq for r in await drain(sub_a, 1.0)) == list(range(150))
        with trio.fail_after(20):
            got = [(await sub_b.receive()).message.seq for _ in range(150)]
        assert sorted(got) == list(range(150))  # all of them; gossip promises no order across messages
        assert not b.gossip.invalid and not b.gossip.rate_limited and not b.gossip.dropped


async def test_a_peer_record_is_verified_when_its_bytes_change_not_on_every_message(monkeypatch):
    # py-libp2p 0.8.1 verifies the signed peer record every RPC carries, on every RPC (agent/net/gossip.py)
    import libp2p.pubsub.utils as pubsub_utils
    from libp2p.peer.peerstore import env_to_send_in_RPC
    from libp2p.pubsub import pb
    from libp2p.pubsub import pubsub as pubsub_module

    verified = []
    consume_envelope = pubsub_utils.consume_envelope
    monkeypatch.setattr(pubsub_utils, "consume_envelope",
                        lambda *args: verified.append(args) or consume_envelope(*args))
    async with agents(2) as (a, b):
        sub_b = await b.gossip.subscribe(TOPIC_JOBS)
        await a.gossip.subscribe(TOPIC_JOBS)
        await mesh_ready([a, b], TOPIC_JOBS)
        before = len(verified)
        for seq in range(30):
            await a.gossip.publish(heartbeat(seq))
        with trio.fail_after(20):
            got = {(await sub_b.receive()).message.seq for _ in range(30)}
        assert got == set(range(30)) and len(verified) - before <= 2, len(verified) - before

        # a record that differs from the one accepted is verified: a forged signature is refused
        check = pubsub_module.maybe_consume_signed_record
        record, _ = env_to_send_in_RPC(a.host.libp2p)
        rpc = pb.rpc_pb2.RPC(senderRecord=record)
        a_id = ID.from_base58(a.peer_id)
        assert check(rpc, b.host.libp2p, a_id)
        count = len(verified)
        assert check(rpc, b.host.libp2p, a_id) and len(verified) == count  # the same bytes: taken as verified
        forged = pb.rpc_pb2.RPC(senderRecord=record[:-1] + bytes([record[-1] ^ 1]))
        assert not check(forged, b.host.libp2p, a_id) and len(verified) == count + 1
        assert not check(rpc, b.host.libp2p, ID.from_base58(b.peer_id))  # a's record is no record of b's
        assert check(rpc, b.host.libp2p, a_id) and len(verified) == count + 2  # nor did it take a's place


async def test_a_flooding_peer_is_rate_limited():
    async with agents(2, gossip_config=GossipConfig(max_rate=20.0, max_burst=20.0)) as (a, b):
        await a.gossip.subscribe(TOPIC_JOBS)
        sub_b = await b.gossip.subscribe(TOPIC_JOBS)
        await mesh_ready([a, b], TOPIC_JOBS)
        for seq in range(60):
            await a.gossip.publish(heartbeat(seq))
        theirs = await drain(sub_b, 2.0)
        assert 20 <= len(theirs) < 60  # b takes a's burst, then its token bucket refills at 20/s
        assert b.gossip.rate_limited[a.peer_id] > 0
        assert not b.gossip.invalid


async def test_expired_replays_from_a_peers_cache_never_blacklist_it():
    """Issue 17: a peer that joins a network older than the envelope window gets each neighbour's
    recent-message cache on subscribing (py-libp2p replays it), old envelopes included. Those are
    refused as ``expired`` but are not misbehaviour: the neighbour is not blamed, not blacklisted,
    and its next fresh message arrives. (The old network is a clock 400 s behind: the same rule.)"""
    from agent.net.host import NetConfig
    from agent.net.stack import open_network

    offset = [-400.0]  # the old peer's messages were signed 400 s ago (the window is 300 s)
    async with open_network(Identity.generate(), clock=lambda: time.time() + offset[0]) as old:
        config = NetConfig(bootstrap=(old.host.addrs()[0],))
        async with open_network(Identity.generate(), config) as joiner:
            await old.gossip.subscribe(TOPIC_JOBS)
            await wait_until(lambda: old.peer_id in joiner.host.connected_peers(), timeout=10)
            for seq in range(80):  # more than blacklist_after (50), all in the cache's window
                await old.gossip.publish(heartbeat(seq))
            sub = await joiner.gossip.subscribe(TOPIC_JOBS)
            await wait_until(lambda: joiner.gossip.reasons["expired"] >= 50, timeout=10)
            assert joiner.gossip.invalid[old.peer_id] == 0
            assert ID.from_base58(old.peer_id) not in joiner.gossip.pubsub.blacklisted_peers
            offset[0] = 0.0
            await mesh_ready([old, joiner], TOPIC_JOBS)
            await old.gossip.publish(heartbeat(1000))
            with trio.fail_after(10):
                while (await sub.receive()).message.seq != 1000:
                    pass


async def test_a_peer_never_replays_from_its_cache_what_its_own_clock_says_expired():
    """Issue 17, "and don't ask for them": a peer's recent-message cache can hold envelopes already
    past the window (its heartbeat, which shifts the cache, was held up; here its clock steps 400 s
    forward right after it published). A new subscriber used to be handed all of them, only to drop
    each as ``expired``; now the cache does not offer them (IPIP-0001 §4), and fresh messages flow."""
    from agent.net.host import NetConfig
    from agent.net.stack import open_network

    offset = [-400.0]
    async with open_network(Identity.generate(), clock=lambda: time.time() + offset[0]) as old:
        config = NetConfig(bootstrap=(old.host.addrs()[0],))
        async with open_network(Identity.generate(), config) as joiner:
            await old.gossip.subscribe(TOPIC_JOBS)
            await wait_until(lambda: old.peer_id in joiner.host.connected_peers(), timeout=10)
            for seq in range(80):
                await old.gossip.publish(heartbeat(seq))
            offset[0] = 0.0  # 400 s later by the old peer's own clock: all 80 are past the window
            assert len(old.gossip.router.mcache.msgs) >= 80 and not old.gossip.router.mcache.window(TOPIC_JOBS)
            sub = await joiner.gossip.subscribe(TOPIC_JOBS)
            await mesh_ready([old, joiner], TOPIC_JOBS)
            await old.gossip.publish(heartbeat(1000))
            with trio.fail_after(10):
                assert (await sub.receive()).message.seq == 1000
            await trio.sleep(0.5)  # anything replayed would have been judged by now
            assert joiner.gossip.reasons["expired"] == 0 and joiner.gossip.invalid[old.peer_id] == 0, (joiner.gossip.reasons, joiner.gossip.invalid)


async def test_a_new_subscriber_is_handed_the_last_heartbeats_messages_not_every_message_since_start():
    """Issue 21 (1): py-libp2p's GossipSub router is a service of its own, and it was never run, so its
    heartbeat never shifted the recent-message cache: each peer handed a new subscriber every message
    it had seen (up to the 300 s envelope window), which the newcomer relayed to peers that had
    forgotten them (py-libp2p's seen cache kept IDs 120 s): refused as ``replayed`` and blamed on the
    newcomer, blacklisted within seconds on a network a few minutes old (scripts/probe_network_age.py,
    separate processes). Now the heartbeat runs: a newcomer gets the last ``gossip_window`` heartbeats
    (3 s) of messages. And the transport remembers what it saw for the whole envelope window, numbers
    messages so that a restart cannot reuse a number its peers still hold as seen, and a ``replayed``
    envelope is never held against the peer that relays it."""
    from agent.net.host import NetConfig
    from agent.net.stack import open_network
    from protocol.envelope import SEEN_TTL_S

    async with open_network(Identity.generate()) as old:
        assert old.gossip.pubsub.seen_messages.ttl == SEEN_TTL_S >= 330  # the window: 300 s + 30 s of skew
        assert old.gossip.pubsub.counter > time.time_ns() - 60 * 10**9  # message numbers from nanoseconds
        await old.gossip.subscribe(TOPIC_JOBS)

        async def publish_on() -> None:
            for seq in range(10_000):
                await old.gossip.publish(heartbeat(seq))
                await trio.sleep(0.25)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish_on)
            await trio.sleep(6)  # 6 s of messages before anyone else subscribes
            async with open_network(Identity.generate(), NetConfig(bootstrap=(old.host.addrs()[0],))) as joiner:
                sub = await joiner.gossip.subscribe(TOPIC_JOBS)
                handed = await drain(sub, 2.0)
                received = time.time()
            nursery.cancel_scope.cancel()
        ages = sorted(received - r.envelope.timestamp_ms / 1000 for r in handed)
        assert handed and min(r.message.seq for r in handed) > 6 and ages[-1] < 6.0, (len(handed), ages[-3:])
    gossip = old.gossip
    gossip._reject(joiner.peer_id, "replayed")
    gossip._reject(joiner.peer_id, "expired")
    assert gossip.invalid[joiner.peer_id] == 0 and gossip.reasons["replayed"] == 1


FROZEN_PEER = """
import sys, trio
from agent.net.host import NetConfig
from agent.net.stack import open_network
from protocol.identity import Identity
from protocol.messages import TOPIC_JOBS

async def main():
    async with open_network(Identity.generate(), NetConfig(bootstrap=(sys.argv[1],))) as net:
        await net.gossip.subscribe(TOPIC_JOBS)
        print(net.peer_id, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_a_frozen_peer_does_not_hold_up_our_publishes():
    """Issue 17: a peer that stops reading (SIGSTOP: frozen, not gone) fills its outbound queue, and
    every publish then waited publish_wait for it (5 s each: a worker's report took ~27 s). Now a
    stalled queue is not waited for: publishing stays fast for everyone else."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    config = GossipConfig(publish_wait=2.0)
    async with agents(2, gossip_config=config) as (me, healthy):
        sub = await healthy.gossip.subscribe(TOPIC_JOBS)
        await me.gossip.subscribe(TOPIC_JOBS)
        child = subprocess.Popen([sys.executable, "-c", FROZEN_PEER, me.host.addrs()[0]], cwd=REPO_ROOT,
                                 stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        try:
            frozen = (await trio.to_thread.run_sync(child.stdout.readline)).decode().strip()
            await wait_until(lambda: {frozen, healthy.peer_id} <= me.gossip.peers_on(TOPIC_JOBS), timeout=30)
            child.send_signal(signal.SIGSTOP)
            queues = me.gossip.pubsub.peer_queues
            filler = JobCancel(bytes(32), "x" * 1000)  # ~1.3 kB: the socket buffers fill sooner
            slowest = 0.0

            async def publish(message) -> None:
                nonlocal slowest
                started = trio.current_time()
                await me.gossip.publish(message)
                slowest = max(slowest, trio.current_time() - started)
                assert slowest < 1.0, f"a publish waited {slowest:.1f} s behind a frozen peer"

            with trio.fail_after(60):  # until its queue stays full: the stream and socket buffers are spent
                stuck = 0
                while stuck < 3:
                    for _ in range(50):
                        await publish(filler)
                    await trio.sleep(0.05)
                    stuck = stuck + 1 if any(len(q) >= 24 for q in queues.values()) else 0
            for seq in range(1, 11):
                await publish(heartbeat(seq))
            with trio.fail_after(15):  # and the healthy peer gets them
                while getattr((await sub.receive()).message, "seq", None) != 10:
                    pass
        finally:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()
