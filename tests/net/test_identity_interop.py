"""The libp2p peer ID py-libp2p computes for a key is the peer ID protocol/identity computes.

So a connection's remote peer and an envelope's signer name the same agent.
"""

import json

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from agent.net.host import Host
from protocol.identity import Identity, peer_id_bytes, public_key_protobuf
from protocol.messages import TOPIC_JOBS, Heartbeat
from tests.conftest import IPIP_VECTORS
from tests.net.conftest import agents, wait_until

pytestmark = pytest.mark.network


def test_vector_seeds_give_the_same_peer_id_in_py_libp2p():
    vectors = json.loads((IPIP_VECTORS / "identity-vectors.json").read_text())["vectors"]
    assert vectors
    for vector in vectors:
        seed = bytes.fromhex(vector["seed_hex"])
        keypair = create_new_key_pair(seed)
        libp2p_id = ID.from_pubkey(keypair.public_key)
        ours = Identity(seed)
        assert libp2p_id.to_base58() == ours.peer_id == vector["peer_id"]
        assert libp2p_id.to_bytes() == peer_id_bytes(ours.public_key)
        assert keypair.public_key.serialize() == public_key_protobuf(ours.public_key)
        assert libp2p_id.extract_public_key().to_bytes() == ours.public_key


def test_host_is_built_from_the_agent_key():
    for _ in range(5):
        identity = Identity.generate()
        host = Host(identity)
        assert host.libp2p.get_id().to_base58() == identity.peer_id
        assert host.libp2p.get_public_key().to_bytes() == identity.public_key


async def test_remote_peer_and_envelope_signer_are_the_same_peer():
    async with agents(2) as (a, b):
        assert b.host.libp2p.get_id() in a.host.libp2p.get_connected_peers()
        # the Noise handshake authenticated b's key: a's connection names b's agent identity
        conns = a.host.libp2p.get_network().get_connections(b.host.libp2p.get_id())
        assert conns and conns[0].muxed_conn.peer_id.to_base58() == b.host.identity.peer_id
        sub = await a.gossip.subscribe(TOPIC_JOBS)
        await b.gossip.subscribe(TOPIC_JOBS)
        await wait_until(lambda: b.peer_id in a.gossip.peers_on(TOPIC_JOBS)
                         and a.peer_id in b.gossip.peers_on(TOPIC_JOBS), timeout=10)
        await b.gossip.publish(Heartbeat(seq=7, active_shards=0, coordinating=()))
        with trio.fail_after(10):
            got = await sub.receive()
        assert got.message.seq == 7
        assert got.signer == got.forwarder == b.host.identity.peer_id
