"""The harness's gossip faults: drop, duplicate, delay/reorder and partition, on real agents."""

import pytest

from agent.net.gossip import GossipFaults
from protocol.messages import TOPIC_JOBS, Heartbeat
from tests.net.conftest import agents
from tests.net.test_gossip import drain, mesh_ready

pytestmark = pytest.mark.network


async def test_faults_act_on_what_an_agent_receives_and_a_partition_heals():
    async with agents(3) as (a, b, c):
        subs = [await n.gossip.subscribe(TOPIC_JOBS) for n in (a, b, c)]
        await mesh_ready([a, b, c], TOPIC_JOBS)
        sub_b = subs[1]

        async def round_trip(seqs, sender=a, seconds=1.5):
            for seq in seqs:
                await sender.gossip.publish(Heartbeat(seq, 0, ()))
            return [r.message.seq for r in await drain(sub_b, seconds)]

        assert sorted(await round_trip(range(1, 4))) == [1, 2, 3]  # no faults: everything, once

        b.gossip.faults = GossipFaults(drop=1.0)
        assert await round_trip(range(10, 13)) == []
        assert b.gossip.faults.injected["dropped"] == 3

        b.gossip.faults = GossipFaults(duplicate=1.0)
        assert sorted(await round_trip(range(20, 23))) == [20, 20, 21, 21, 22, 22]

        b.gossip.faults = GossipFaults(delay=(0.05, 0.6), seed=4)
        got = await round_trip(range(30, 50), seconds=2.5)
        assert sorted(got) == list(range(30, 50)), "delayed, not lost"
        assert got != sorted(got), "a spread of delays reorders"

        b.gossip.faults = GossipFaults(blocked=frozenset({a.peer_id}))  # partition: b cut off from a
        assert await round_trip(range(60, 63), sender=a) == []
        assert sorted(await round_trip(range(70, 73), sender=c)) == [70, 71, 72]
        b.gossip.faults.blocked = frozenset()  # heal
        assert sorted(await round_trip(range(80, 83), sender=a)) == [80, 81, 82]
