"""A claim heard before the coordinator's own election tick names it is granted when it takes over.

Each agent starts a job's election after its own ``grace_seconds``; a worker whose grace ended first
claims while the coordinator-to-be does not coordinate yet. That claim used to be dropped, and the
worker waited ``2 x claim_interval`` to claim again while a faster worker took every shard (the
coordinator-judged scenario failed so under load). Here the coordinator's grace is 3 s longer than
the workers' and a claim is not repeated for a minute: the workers' first claims must get leases.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio

from protocol import state as st
from protocol.election import elect
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


async def test_claims_heard_before_the_election_are_granted_on_take_over(tmp_path, tiny_model_dir):
    workers = 3
    overrides = {i: {"claim_interval": 30.0} for i in range(workers)}
    async with network(tmp_path, tiny_model_dir, workers=workers, overrides=overrides) as net:
        spec = fast_spec(shards=3, rounds=1)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"),
                                                            str(tiny_model_dir))
        coordinator_id = elect(terms.job_id(), [w.peer_id for w in net.workers])
        coordinator = next(w for w in net.workers if w.peer_id == coordinator_id)
        others = {w.peer_id for w in net.workers} - {coordinator_id}
        coordinator.config = replace(coordinator.config, grace_seconds=coordinator.config.grace_seconds + 3.0)
        started = trio.current_time()
        view = await net.submitter.submitter.announce(terms)

        def leased() -> set[str]:
            return {lease.worker for lease in view.leases.values()}

        # without the remembered claims no lease comes before 2 x claim_interval = 60 s
        await net.submitter.wait_for(lambda: others <= leased(), timeout=20)
        assert trio.current_time() - started < 20
        remembered = coordinator.coordinator
        assert not remembered._early.get(view.job_id)  # handed to take_over, not kept
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=60)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
