"""Issue 17: a full disk must not bring an agent down. A worker whose store cannot be written refuses
new work with a clear reason, stays up and in the network, and takes work again once there is room."""

from __future__ import annotations

import pytest
import trio

from agent.control import _status
from protocol.election import elect
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
