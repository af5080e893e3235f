"""Issue 17 (1): an agent that joins, or restarts, after the network has run past the 300 s message
window blames no peer for the old envelopes it is handed, hears its peers and takes work.

Seen by hand: a worker joining a 6-minute-old network counted 100 ``expired`` envelopes from its
neighbours' caches, blacklisted them, had no live peer, and a shard stayed OPEN. Here the network
first runs on a clock 400 s behind; then that clock steps forward 400 s at once (as if the network
had run that long: everything signed so far is past the window, by every peer's clock), and at that
moment one worker restarts and another joins for the first time. Same rule as in real time, the
window unchanged (protocol/envelope.MAX_AGE_S). Real agents on loopback, real gossip, real stores.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import trio
from libp2p.peer.id import ID

import agent.harness.network as harness_network
from agent.node import Agent
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_agents_joining_or_restarting_after_the_message_window_blame_nobody_and_take_work(
        tmp_path, tiny_model_dir, monkeypatch):
    offset = [-400.0]
    monkeypatch.setattr(harness_network, "Agent", partial(Agent, clock=lambda: time.time() + offset[0]))
    async with network(tmp_path, tiny_model_dir, workers=3, late=(2,)) as net:
        w0, w1 = net.workers
        terms = await net.submitter.submitter.prepare_terms(fast_spec(shards=4, rounds=1),
                                                            write_dataset(tmp_path / "d.jsonl"), str(tiny_model_dir))
        await trio.sleep(2)  # heartbeats and capabilities, signed on the old clock, fill every cache
        offset[0] = 0.0  # 400 s pass at once: all of it is now older than the window
        await net.kill(w1)
        restarted = await net.restart(w1)
        joined = await net.start("w2", net.configs["w2"])
        newcomers = (restarted, joined)
        everyone = [net.submitter, w0, restarted, joined]

        with trio.fail_after(30):  # each newcomer hears every other peer
            while any({a.peer_id for a in everyone} - {n.peer_id} - n.live_peers() for n in newcomers):
                await trio.sleep(0.2)

        view = await net.submitter.submitter.announce(terms)
        with trio.fail_after(60):  # and takes work: it trains a shard, or coordinates the job
            while True:
                leased = {s.worker for s in view.state.shards if s.worker}
                coordinator = view.coordination.coordinator
                if all(n.peer_id in leased or n.peer_id == coordinator for n in newcomers):
                    break
                await trio.sleep(0.2)

        for agent in everyone:
            gossip = agent.net.gossip
            assert not any(gossip.invalid.values()), (agent.peer_id, gossip.invalid, gossip.reasons)
            assert not any(ID.from_base58(a.peer_id) in gossip.pubsub.blacklisted_peers for a in everyone)
