"""Issue #15 item 6: blocking work stays off the trio event loop. The agent's store writes made from
the loop (ledger entries, job rows, the write probe before a claim) run in the store's worker thread,
so a commit in flight (an evidence batch syncing, a slow disk) never stalls heartbeats and gossip;
bundles (up to GiBs) are packed and unpacked in worker threads.

Real parts: a real Agent (not on a network) with a real SQLite store, a real commit holding the
store, real files packed and unpacked.
"""

from __future__ import annotations

import threading
import time

import trio
import trio.testing

from agent.bundle import ADAPTER_FILES, pack_dir_off_loop, unpack_off_loop
from agent.store import StoreFullError
from tests.roles.test_evidence import JOB, NOW, observer_agent

HOLD = 1.5  # seconds a commit in another thread holds the store


async def _max_tick_gap(work, *, period: float = 0.01) -> float:
    """Run ``work()`` while a task ticks every ``period``; the longest the ticker waited between ticks."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t0 = time.perf_counter()
            await trio.sleep(period)
            gaps.append(time.perf_counter() - t0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(period * 3)  # the ticker runs before the work starts
        try:
            await work()
        finally:
            done = True
    return max(gaps)


def test_store_writes_from_the_loop_never_wait_on_a_commit_in_flight(tmp_path):
    agent, view = observer_agent(tmp_path)
    store = agent.store
    held, release = threading.Event(), threading.Event()

    def slow_commit() -> None:  # an evidence batch syncing on a slow disk: it holds the store for HOLD s
        with store.transaction():
            store.probe_write()
            held.set()
            release.wait(HOLD)

    async def main() -> tuple[float, float, bool]:
        async with trio.open_nursery() as nursery:
            agent.nursery = nursery
            nursery.start_soon(agent.writer.run)
            holder = threading.Thread(target=slow_commit)
            holder.start()
            await trio.to_thread.run_sync(held.wait)
            started = time.perf_counter()
            probed: list[bool] = []

            async def work() -> None:
                # what the roles and the state machine do on the loop while the commit is in flight
                agent.ledger(JOB, "coordinator", {"term": 1})
                view.state = view.state.__class__(**{**view.state.__dict__, "round": 2})
                agent.save_job_row(view)
                agent.ledger(JOB, "done", {})
                probed.append(await agent.can_take_work())  # the probe before a claim waits in a thread

            gap = await _max_tick_gap(work)
            waited = time.perf_counter() - started
            await trio.to_thread.run_sync(holder.join)
            with trio.fail_after(10):  # the writer made the queued writes once the commit ended
                while store.pending():
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return gap, waited, probed == [True]

    gap, waited, probed = trio.run(main)
    assert waited >= HOLD * 0.8, "the probe waited for the commit in flight (one store thread at a time)"
    # on the loop, the first ledger append would have blocked the loop until the commit ended (HOLD s)
    assert gap < HOLD / 3, f"the event loop stalled for {gap:.2f} s"
    assert probed
    assert [e.kind for e in store.ledger(JOB)] == ["coordinator", "done"]  # in the order they were made
    assert store.job(JOB).round == 2
    store.close()


def test_writes_queued_are_seen_by_reads_and_made_when_the_store_closes(tmp_path):
    agent, view = observer_agent(tmp_path)
    store = agent.store

    async def queue() -> None:
        agent.ledger(JOB, "coordinator", {"term": 1})  # queued: no writer task runs in this test

    trio.run(queue)
    assert store.pending() == 1
    assert [e.kind for e in store.ledger(JOB)] == ["coordinator"]  # a read makes the queued writes first
    assert store.pending() == 0

    async def queue_more() -> None:
        agent.ledger(JOB, "done", {})

    trio.run(queue_more)
    store.close()  # made before the store closes
    from agent.store import Store

    with Store.in_data_dir(tmp_path, agent.identity) as again:
        assert [e.kind for e in again.ledger(JOB)] == ["coordinator", "done"]
        assert again.verify_ledger(JOB) == 2


async def _writer_running(agent, nursery) -> None:
    """Start the agent's store writer task and let it reach its first wait."""
    nursery.start_soon(agent.writer.run)
    await trio.testing.wait_all_tasks_blocked()


def test_a_read_on_the_event_loop_does_not_make_the_queued_writes_there(tmp_path):
    agent, view = observer_agent(tmp_path)
    store = agent.store
    made_on: list[int] = []

    def append(kind: str, data: dict) -> None:  # a queued ledger append that notes which thread made it
        made_on.append(threading.get_ident())
        store.append_event(JOB, kind, data, NOW)

    async def main() -> tuple[int, list[str], list[str]]:
        async with trio.open_nursery() as nursery:
            await _writer_running(agent, nursery)
            loop = threading.get_ident()
            agent.write_soon(append, "coordinator", {"term": 1})
            agent.write_soon(append, "done", {})
            seen = [e.kind for e in store.ledger(JOB)]  # same tick: the writer has not run yet
            await agent.flush_writes()  # a caller that must see what it queued
            after = [e.kind for e in store.ledger(JOB)]
            nursery.cancel_scope.cancel()
        return loop, seen, after

    loop, seen, after = trio.run(main)
    assert made_on and loop not in made_on, "a read on the event loop made the queued writes (fsyncs) there"
    assert seen == []  # the read on the loop lags the queue by a moment
    assert after == ["coordinator", "done"]  # flush_writes: read-your-writes, in the order queued
    store.close()


def test_a_read_on_the_event_loop_waits_for_at_most_one_write_of_the_writer(tmp_path):
    agent, view = observer_agent(tmp_path)
    store = agent.store
    slow, count = 0.3, 5
    started = threading.Event()

    def slow_append(seq: int) -> None:  # a queued write on a slow disk
        started.set()
        time.sleep(slow)
        store.append_event(JOB, "coordinator", {"term": seq}, NOW)

    async def main() -> tuple[float, float]:
        async with trio.open_nursery() as nursery:
            await _writer_running(agent, nursery)
            for seq in range(count):
                agent.write_soon(slow_append, seq)
            await trio.to_thread.run_sync(started.wait)  # the writer is in its first write
            t0 = time.perf_counter()
            store.ledger(JOB)  # on the loop, as ledger sync, `job watch` and reputations read
            waited = time.perf_counter() - t0
            t0 = time.perf_counter()
            await agent.flush_writes()
            flushed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
        return waited, flushed

    waited, flushed = trio.run(main)
    assert waited < slow * 2, f"a read on the loop waited {waited:.2f} s behind the writer's batch"
    assert flushed > slow * 2  # the rest of the batch was still to be made then
    assert [e.data["term"] for e in store.ledger(JOB)] == list(range(count))
    store.close()


def test_an_error_of_a_queued_write_made_by_another_threads_read_is_acted_on(tmp_path):
    agent, view = observer_agent(tmp_path)
    store = agent.store

    def full() -> None:
        raise StoreFullError(f"{store.path}: cannot write: the disk is full")

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            await _writer_running(agent, nursery)
            store.later(full)  # queued without waking the writer; a read in a worker thread makes it
            await trio.to_thread.run_sync(store.ledger, JOB)
            assert agent.store_full is None
            t0 = time.perf_counter()
            with trio.fail_after(5):
                while agent.store_full is None:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        return time.perf_counter() - t0

    waited = trio.run(main)
    assert waited < 2.5 and "disk is full" in agent.store_full
    store.close()


def test_packing_and_unpacking_a_large_bundle_leaves_the_event_loop_running(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with open(adapter / "adapter_model.safetensors", "wb") as fh:  # 256 MiB of real bytes on disk
        block = bytes(range(256)) * 4096
        for _ in range(256):
            fh.write(block)
    ticks: dict[str, int] = {}

    async def main() -> None:
        count = 0
        running = True

        async def ticker() -> None:
            nonlocal count
            while running:
                await trio.sleep(0)
                count += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0)
            before = count
            bundle = await pack_dir_off_loop(adapter, tmp_path / "adapter.tar")
            ticks["pack"] = count - before
            before = count
            await unpack_off_loop(bundle, tmp_path / "out", allowed=ADAPTER_FILES, max_bytes=1 << 30)
            ticks["unpack"] = count - before
            running = False

    trio.run(main)
    # on the event loop the ticker could not run at all while the bundle was written; in a thread it runs on
    assert ticks["pack"] > 10 and ticks["unpack"] > 10, ticks
    assert (tmp_path / "out" / "adapter_model.safetensors").stat().st_size == 256 << 20
