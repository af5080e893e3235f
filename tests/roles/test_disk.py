"""An agent's disk stays within its quota through a long job, and what no job needs is collected
(agent/disk.py; issue 25: every round's work directory and every block were kept forever)."""

from __future__ import annotations

import os

import pytest
import trio

from agent import disk
from protocol import state as st
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network


def _home_bytes(home) -> int:
    total = 0
    for root, _, files in os.walk(home):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass  # removed meanwhile (a probe file, a collected block)
    return total


async def _run(tmp_path, tiny_model_dir, rounds: int) -> None:
    dataset = write_dataset(tmp_path / "demo.jsonl")
    spec = fast_spec(shards=2, rounds=rounds, max_steps=4, lease_seconds=60)
    # w0 coordinates (it is first by rank) and trains; w1 trains under a quota of what about four of
    # its rounds use, and collects with no grace (the test's rounds last seconds, not minutes)
    quota_gb = 0.016
    overrides = {1: {"max_disk_gb": quota_gb, "disk_grace_seconds": 0.0, "can_coordinate": False}}
    async with network(tmp_path, tiny_model_dir, workers=2, overrides=overrides) as net:
        submitter, (w0, w1) = net.submitter, net.workers
        terms = await submitter.submitter.prepare_terms(spec, dataset, str(tiny_model_dir))
        peak = {"w0": 0, "w1": 0}

        async def sample() -> None:
            while True:
                for name, agent in (("w0", w0), ("w1", w1)):
                    peak[name] = max(peak[name], await trio.to_thread.run_sync(_home_bytes, agent.config.home))
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            view = await submitter.submitter.announce(terms)
            await submitter.wait_for(lambda: view.state.terminal, timeout=60 + 20 * rounds)
            nursery.cancel_scope.cancel()
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        trained = {name: sum(1 for (_, w) in view.reports.values() if w == agent.peer_id)
                   for name, agent in (("w0", w0), ("w1", w1))}
        assert trained["w1"] >= rounds // 2, trained  # the quota did not keep w1 from working
        assert peak["w1"] < quota_gb * disk.GB, (peak, trained)  # never over its quota, sampled every 0.1 s
        assert w1.disk.collected.dirs > 0 and w1.disk.collected.blocks > 0
        # w1 kept only the last rounds' work directories of the job: the current and the previous one at
        # its last collection (before a claim), plus what it trained since; under a loaded CI its mirror
        # may still be in the round before when it claims, so one more round may stay (seen once in CI); and an
        # early start (IPIP-0006 §2.9) takes round r + 1's work, and collects before it, while its mirror is in
        # round r, so one more (seen once in CI: r2 kept at the end of 6 rounds)
        job_dir = w1.work_dir / view.job_id.hex()[:16]
        kept = sorted(p.name for p in job_dir.iterdir()) if job_dir.exists() else []
        assert all(int(name.split("-")[0][1:]) >= rounds - 4 for name in kept if name.startswith("r")), kept
        print(f"\ndisk peaks over {rounds} rounds: w1 (quota {quota_gb} GB) {peak['w1'] / 1e6:.1f} MB, "
              f"w0 (no quota) {peak['w0'] / 1e6:.1f} MB; w1 collected {w1.disk.collected.bytes / 1e6:.1f} MB; "
              f"trained {trained}")
        # the job is over and not w1's: once collected, nothing of it is left on w1
        await w1.wait_for(lambda: w1.jobs[view.job_id].state.terminal, timeout=30)
        await w1.collect_disk()
        assert not job_dir.exists()
        # w0 (no quota, the default grace) collected nothing young: every round's aggregate is still on its disk
        # (its peak is no longer above w1's: as verifier it fetches only the checkpoints its replays read)
        from protocol.cid import parse_cid

        assert w0.disk.collected.bytes == 0, peak
        assert all(w0.content.store.has(parse_cid(a.adapter_cid)) for a in view.aggregates.values())
        # the submitter's own job is kept whole: its final aggregate can still be fetched from it
        await submitter.collect_disk()
        final = view.aggregates[rounds]
        assert submitter.content.store.has(__import__("protocol.cid", fromlist=["parse_cid"]).parse_cid(
            final.adapter_cid))


async def test_a_worker_stays_within_its_disk_quota(tmp_path, tiny_model_dir):
    await _run(tmp_path, tiny_model_dir, rounds=6)


@pytest.mark.slow
async def test_a_worker_stays_within_its_disk_quota_through_20_rounds(tmp_path, tiny_model_dir):
    await _run(tmp_path, tiny_model_dir, rounds=20)
