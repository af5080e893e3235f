"""/infernet/ledger/1.1.0 over real hosts (IPIP-0008 §5.1): a client that names what it holds is sent only the
rest; a peer that serves only 1.0.0 (an older agent) still answers, with every entry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent.ledger_sync import PROTOCOL, LedgerService, absorb, fetch_chains, served_chains
from agent.store import Store
from protocol.identity import Identity
from tests.net.conftest import agents

pytestmark = pytest.mark.network

JOB = bytes(range(32))


async def test_a_sync_sends_what_the_client_lacks_and_falls_back_to_1_0_0(tmp_path):
    async with agents(3) as (client, server, old):  # (the first is the others' bootstrap: connected to both)
        with Store(tmp_path / "s" / "agent.sqlite3", Identity.generate()) as served, \
                Store(tmp_path / "c" / "agent.sqlite3", Identity.generate()) as holder, \
                Store(tmp_path / "o" / "agent.sqlite3", Identity.generate()) as older:
            for i in range(6):
                served.append_event(JOB, "checkpoint", {"round": 1, "shard": 0, "attempt": 1, "step": i, "loss": 1.0}, 1.0)
                older.append_event(JOB, "checkpoint", {"round": 1, "shard": 1, "attempt": 1, "step": i, "loss": 1.0}, 1.0)
            LedgerService(SimpleNamespace(store=served)).install(server.host)
            old.host.set_handler(PROTOCOL, LedgerService(SimpleNamespace(store=older)).handle, timeout=20)  # 1.0.0 only

            async def sync(peer: str) -> tuple[int, int]:
                pairs = await fetch_chains(client.host, peer, JOB, 10.0, holder.chain_heads(JOB))
                chains, invalid = served_chains(pairs, JOB, peer)
                assert not invalid
                return len(pairs), absorb(holder, JOB, chains, peer, 1.0)[0]

            assert await sync(server.peer_id) == (6, 6)  # nothing held yet: all of it
            assert await sync(server.peer_id) == (0, 0)  # up to date: nothing sent
            served.append_event(JOB, "done", {}, 2.0)
            assert await sync(server.peer_id) == (1, 1)  # one more entry: that one
            assert await sync(old.peer_id) == (6, 6)
            assert await sync(old.peer_id) == (6, 0)  # an older agent sends every entry, as it always did
            assert [e.hash for e in holder.ledger_copy(JOB, served.identity.public_key)] == \
                [e.hash for e in served.ledger(JOB)]
            assert holder.conflicts(JOB) == []
