"""Issue 17: a full disk must not bring an agent down. A worker whose store cannot be written refuses
new work with a clear reason, stays up and in the network, and takes work again once there is room."""

from __future__ import annotations

import pytest
import trio

from agent.control import _status
from protocol.election import elect
from tests.conftest import fill_disk, tmpfs
from tests.roles.conftest import fast_spec, network, write_dataset

pytestmark = pytest.mark.network

UNLIMITED = 1073741823


async def test_a_worker_with_a_full_disk_refuses_work_stays_up_and_resumes_when_there_is_room(tmp_path, tiny_model_dir):
    async with network(tmp_path, tiny_model_dir, workers=3, reannounce_seconds=1.0) as net:
        spec = fast_spec(shards=2, rounds=1)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"),
                                                            str(tiny_model_dir))
        # the disk fills up on a worker that will not coordinate (one coordinates, one trains)
        coordinator = elect(terms.job_id(), [w.peer_id for w in net.workers])
        full = next(w for w in net.workers if w.peer_id != coordinator)
        fill_up(full.store._db)  # SQLite's own SQLITE_FULL ('database or disk is full') from here on
        view = await net.submitter.submitter.announce(terms)
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=120)  # the other worker does it all
        assert view.state.phase.value == "DONE", view.state.reason
        assert net.running(full_name(net, full)) and full.peer_id in net.submitter.live_peers()  # still up
        assert "cannot write: the disk is full" in (full.store_full or "")
        assert (await _status(full))["refusing_work"] == full.store_full
        assert not any(v.worker == full.peer_id for v in view.verdicts.values())  # it took no work
        full.store._db.execute(f"PRAGMA max_page_count = {UNLIMITED}")  # room again: it takes work again
        with trio.fail_after(30):
            while full.store_full is not None:
                await trio.sleep(0.1)
        assert (await _status(full))["refusing_work"] is None


def fill_up(db) -> None:
    """Fill the store's free pages and cap its size: every later write that needs a page fails."""
    import sqlite3

    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages + 4}")
    db.execute("CREATE TABLE filler (x BLOB)")
    try:
        while True:
            db.execute("INSERT INTO filler VALUES (zeroblob(512))")
    except sqlite3.OperationalError as exc:
        assert "full" in str(exc)


def full_name(net, agent) -> str:
    return next(name for name, a in net.agents.items() if a is agent)


async def test_an_agent_restarted_on_a_full_disk_says_why_and_stays_up_refusing_work(tmp_path, tiny_model_dir,
                                                                                    monkeypatch, caplog):
    """Issue 17 item 5: restarted over a store on a full disk, an agent used to say "ready" then die (a
    job row corrected on resume, a file hash saved by its ticks: writes made outside the full-disk
    guard). Now it resumes its jobs, says why it refuses work, stays up and in the network, and takes
    no work until there is room again. (SQLite's max_page_count fails only the writes that need a new
    page, as a long file-hash entry does; an in-place row update still fits.)"""
    import logging
    import sqlite3
    from pathlib import Path

    from agent.store import STORE_FILENAME, Store

    async with network(tmp_path, tiny_model_dir, workers=2, reannounce_seconds=1.0) as net:
        spec = fast_spec(shards=2, rounds=1)
        terms = await net.submitter.submitter.prepare_terms(spec, write_dataset(tmp_path / "d.jsonl"),
                                                            str(tiny_model_dir))
        coordinator = elect(terms.job_id(), [w.peer_id for w in net.workers])
        victim = next(w for w in net.workers if w.peer_id != coordinator)  # the one worker that can train
        name, home = full_name(net, victim), victim.config.home
        view = await net.submitter.submitter.announce(terms)
        with trio.fail_after(30):
            while view.job_id not in victim.jobs or victim.store.job(view.job_id) is None:
                await trio.sleep(0.05)
        await net.kill(name)
        # killed between a message that applied and its job row: on resume the row is corrected
        with sqlite3.connect(home / STORE_FILENAME) as db:
            db.execute("UPDATE jobs SET state = 'AGGREGATING' WHERE job_id = ?", (view.job_id,))
        db.close()

        opened = Store.in_data_dir.__func__

        def full_disk(cls, data_dir, identity):  # the store opens on a disk that is (or soon is) full
            store = opened(cls, data_dir, identity)
            if Path(data_dir) == home:
                fill_up(store._db)
            return store

        monkeypatch.setattr(Store, "in_data_dir", classmethod(full_disk))
        leases_before = sum(lease.worker == victim.peer_id for lease in view.leases.values())
        caplog.set_level(logging.ERROR, logger="agent.node")
        restarted = await net.restart(name)
        # a file hashed meanwhile (by a training or replay thread): the agent's ticks save it to the store
        from agent.train.model import FILE_HASHES

        FILE_HASHES.put((f"{tmp_path}/{'m' * 200}" * 25 + "/model.safetensors", 1, 1), "ab" * 32)
        with trio.fail_after(30):
            while restarted.store_full is None:
                await trio.sleep(0.05)
        assert "cannot write: the disk is full" in restarted.store_full
        assert any("refusing new work" in r.getMessage() and "disk is full" in r.getMessage() for r in caplog.records)
        assert view.job_id in restarted.jobs  # its job resumed
        await trio.sleep(3 * restarted.config.heartbeat_seconds)  # its ticks and heartbeats run on
        assert net.running(name) and restarted.peer_id in net.submitter.live_peers()  # still up, still heard
        assert (await _status(restarted))["refusing_work"] == restarted.store_full
        assert sum(lease.worker == victim.peer_id for lease in view.leases.values()) == leases_before  # no work
        restarted.store._db.execute(f"PRAGMA max_page_count = {UNLIMITED}")  # room again: it takes work again
        with trio.fail_after(30):
            while restarted.store_full is not None:
                await trio.sleep(0.1)


def test_a_full_work_disk_is_found_by_the_claim_probe_even_when_the_store_has_room(tmp_path):
    """The soak: with the disk full, SQLite still had free pages, so the store's probe passed while every
    shard failed with ENOSPC; the worker claimed, failed and gave back one shard three times in a second.
    The claim probe now writes in the work directory too. A real full disk: a 2 MiB tmpfs (root only)."""
    from agent.writer import probe_work_dir
    from agent.store import StoreFullError

    work = tmp_path / "work"
    work.mkdir()
    with tmpfs(work, "2m"):
        probe_work_dir(work)  # room: passes, leaves nothing behind
        assert not list(work.iterdir())
        fill_disk(work / "filler")
        with pytest.raises(StoreFullError, match="no room for new work"):
            probe_work_dir(work)
        (work / "filler").unlink()
        probe_work_dir(work)  # room again


def test_a_store_opened_on_a_full_disk_is_a_full_disk_not_a_damaged_store(tmp_path):
    """The soak filled a worker's disk 4 s after it restarted: SQLite could not grow its WAL at open and
    said "disk I/O error"; the agent called its store unusable and exited 1. On a full disk that is
    StoreFullError (the agent waits for room: StoreWriter.open, agent/writer.py). A real full disk: a tmpfs (root only)."""
    from agent.store import STORE_FILENAME, Store, StoreFullError
    from protocol.identity import Identity

    home = tmp_path / "home"
    home.mkdir()
    with tmpfs(home, "4m"):
        identity = Identity.generate()
        with Store.in_data_dir(home, identity) as store:
            store.append_event(bytes(32), "done", {}, 1.0)
        assert not (home / f"{STORE_FILENAME}-wal").exists()  # closed cleanly: the WAL is checkpointed away
        fill_disk(home / "filler")
        # SQLite cannot create its WAL: "disk I/O error" (before: "not a usable infernet store")
        with pytest.raises(StoreFullError, match="cannot open the store: the disk is full"):
            Store.in_data_dir(home, identity)
        (home / "filler").unlink()
        with Store.in_data_dir(home, identity) as store:  # room again: the same store, whole
            assert len(store.ledger(bytes(32))) == 1


async def test_a_full_disk_collects_at_once_with_a_short_grace_and_takes_work_again(tmp_path):
    """The demo on a 600 MB disk: full at 30 s, and its agents idle until 180 s, when the collection every 60 s
    found the blocks it could delete older than its grace of 120 s. Now a claim's probe that meets a full disk
    collects at once (agent/disk.py FULL_GRACE: files a minute old go), probes again and takes the work. A real
    full disk: a tmpfs (root only); a real store, block store and collection."""
    import os
    import time

    from agent.content.blockstore import BlockStore
    from agent.disk import Disk
    from agent.store import Store
    from agent.writer import FULL_COLLECT_EVERY, FULL_GRACE, StoreWriter
    from protocol.cid import CID, RAW
    from protocol.identity import Identity

    home = tmp_path / "home"
    home.mkdir()
    with tmpfs(home, "6m"):
        blocks = BlockStore(home / "blocks")
        disk = Disk(home, home / "work", home / "blocks", None)
        graces = []

        async def collect_disk(grace=None):
            graces.append(grace)
            await disk.collect_jobs([], "me", (), blocks, grace=grace)

        writer = StoreWriter(time.monotonic, home / "work", disk, collect_disk, lambda: None)
        writer.store = Store.in_data_dir(home, Identity.generate())
        old = time.time() - 60  # a minute old: inside the usual grace, outside a full disk's
        for i in range(8):  # 2 MiB of blocks no job needs
            data = os.urandom(256 * 1024) + bytes([i])
            cid = CID.for_block(data, RAW)
            blocks.put(cid, data)
            os.utime(blocks.path_for(cid), (old, old))
        fill_disk(home / "filler")
        assert await writer.can_take_work()  # collected at once, with the short grace, and room found
        assert graces == [FULL_GRACE] and FULL_GRACE < disk.grace
        assert writer.store_full is None and disk.collected.blocks == 8
        fill_disk(home / "filler2")  # full again at once: no second collection within FULL_COLLECT_EVERY
        assert not await writer.can_take_work()
        assert graces == [FULL_GRACE] and "full" in (writer.store_full or "") and FULL_COLLECT_EVERY > 0
        writer.store.close()


def test_a_full_disk_is_told_from_other_failures_of_a_shard(tmp_path):
    """The worker gives a shard back for its own machine (``cause: local``, an excused attempt, IPIP-0004 §5) when
    the failure came from its full disk: the OSError a write raises there, or a library's error raised from it;
    a training that crashed for another reason is not. A real full disk: a 1 MiB tmpfs (root only)."""
    import errno
    from agent.store import StoreFullError, full_disk

    assert not full_disk(RuntimeError("training crashed"))
    assert not full_disk(OSError(errno.ENOENT, "No such file or directory"))
    assert full_disk(StoreFullError("cannot write: the disk is full"))
    small = tmp_path / "small"
    small.mkdir()
    with tmpfs(small, "1m"):
        from safetensors.numpy import save_file
        import numpy as np

        fill_disk(small / "filler")
        with pytest.raises(OSError) as written:
            with open(small / "one-more", "wb", buffering=0) as out:
                out.write(b"\0" * 65536)
        assert written.value.errno == errno.ENOSPC and full_disk(written.value)
        try:  # what a checkpoint's write raises there: safetensors' own error, naming the OS error
            save_file({"w": np.zeros(1 << 18, dtype=np.float32)}, str(small / "adapter.safetensors"))
        except Exception as exc:  # noqa: BLE001 - its type is the library's
            assert full_disk(exc), exc
        try:  # and raised from the OSError, as a training step's failure is
            try:
                open(small / "more", "wb", buffering=0).write(b"\0" * 4096)
            except OSError as exc:
                raise RuntimeError("checkpoint 2 could not be written") from exc
        except RuntimeError as exc:
            assert full_disk(exc)


async def test_a_shard_given_back_for_the_workers_own_full_disk_costs_the_job_no_attempt(tmp_path, tiny_model_dir):
    """max_retries 0: one failed attempt fails a shard for the round, and the job with it. Each worker's first shard
    fails as a full disk fails a write (ENOSPC); the worker gives it back for its own machine (``cause: local``),
    the attempt is excused, and the shards are trained again: the job ends DONE, nobody blamed. Before, the first
    release failed the job."""
    from protocol import state as st

    dataset = write_dataset(tmp_path / "demo.jsonl")
    async with network(tmp_path, tiny_model_dir, workers=3,
                       misbehave={i: "disk_full_once" for i in range(3)}) as net:
        terms = await net.submitter.submitter.prepare_terms(fast_spec(shards=2, rounds=1, max_retries=0), dataset,
                                                            str(tiny_model_dir))
        view = await net.submitter.submitter.announce(terms)
        await net.submitter.wait_for(lambda: view.state.terminal, timeout=120)
        assert view.state.phase is st.JobPhase.DONE, view.state.reason
        assert all(v.accepted for v in view.verdicts.values()), view.verdicts
        # at least one shard was given back and trained again: its report is of a later attempt
        assert max(key[2] for key in view.reports) >= 2, sorted(view.reports)
        assert all(shard.excused >= 1 for shard in view.state.shards if shard.attempt >= 2), view.state.shards
