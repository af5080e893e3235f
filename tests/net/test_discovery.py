"""Provider records in the DHT (agent/net/discovery.py): a key a DHT server confirmed a moment ago is not provided
again (a worker fetched, and provided, its shard every round), the record stays findable, and the worker key is
advertised every time it is asked."""

from __future__ import annotations

import pytest

from agent.net.discovery import WORKERS_KEY
from protocol.cid import CID, RAW
from tests.net.conftest import agents

pytestmark = pytest.mark.network


async def test_a_key_confirmed_a_moment_ago_is_not_provided_again(monkeypatch):
    async with agents(3) as (a, b, c):
        sent: list[bytes] = []
        store = a.discovery.dht.provider_store
        original = store.provide

        async def counted(key: bytes) -> bool:
            sent.append(key)
            return await original(key)

        monkeypatch.setattr(store, "provide", counted)
        cid = CID.for_block(b"a shard every round fetches", RAW)
        assert await a.discovery.provide(cid) is True
        assert await a.discovery.provide(cid) is True and await a.discovery.provide(cid) is True
        assert len(sent) == 1  # once, not every round
        assert await a.discovery.provide(cid, again=True) is True and len(sent) == 2
        assert [p.peer_id for p in await c.discovery.find_providers(cid, timeout=10)] == [a.host.libp2p.get_id()]
        await a.discovery.advertise_worker()
        await a.discovery.advertise_worker()
        assert sent[2:] == [WORKERS_KEY.multihash] * 2  # how peers find a worker: every time
