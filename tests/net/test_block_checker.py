"""The client side of /infernet/blocks: the checker thread that verifies, stores and writes out the
blocks the network task receives (agent/content/exchange.py ``_Checker``)."""

import os
import threading

import pytest
import trio

from agent.content.exchange import _Checker, first_error
from protocol.errors import CIDError
from protocol.unixfs import StreamVerifier, import_bytes

CHUNK = 1024


def dag(n_chunks: int) -> tuple[StreamVerifier, list[bytes]]:
    root, blocks = import_bytes(os.urandom(n_chunks * CHUNK), chunk_size=CHUNK)
    return StreamVerifier(root), [block.data for block in blocks]


async def test_the_network_task_waits_when_the_checker_is_behind_and_every_block_arrives_in_order():
    verifier, blocks = dag(12)
    gate = threading.Event()
    seen: list[bytes] = []

    def slow_disk(cid, data, payload):
        gate.wait(10)  # the first block's write takes until the gate opens
        seen.append(data)

    async def open_gate_later() -> None:
        await trio.sleep(0.3)
        gate.set()

    checker = _Checker(verifier, slow_disk, max_bytes=3 * CHUNK)
    peak = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(checker.run)
        nursery.start_soon(open_gate_later)
        try:
            with trio.fail_after(10):
                for data in blocks:
                    await checker.put(data)
                    peak = max(peak, checker.queued)
        finally:
            checker.close()
    assert 3 * CHUNK <= peak <= 3 * CHUNK + max(map(len, blocks))  # the queue filled, then put waited
    assert seen == blocks and verifier.done


async def test_a_bad_block_stops_the_checker_names_its_cid_and_leaves_the_verifier_there():
    verifier, blocks = dag(6)
    checker = _Checker(verifier, lambda *_: None)
    bad = 3
    expected_cid = None
    with pytest.raises(BaseExceptionGroup) as failure:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(checker.run)
            try:
                with trio.fail_after(10):
                    for i, data in enumerate(blocks):
                        if i == bad:
                            while checker.queued:  # the good blocks are checked: the bad one is next
                                await trio.sleep(0.01)
                            expected_cid = verifier.expected()
                            data = b"not " + data
                        if not await checker.put(data):
                            break
                        if i > bad:
                            await trio.sleep(0.1)  # give the thread time to stop on the bad block
            finally:
                checker.close()
    error = first_error(failure.value)
    assert isinstance(error, CIDError) and str(expected_cid) in str(error)
    assert verifier.expected() == expected_cid  # another provider can continue from here


async def test_an_aborted_request_drops_the_queued_blocks_and_the_thread_ends():
    verifier, blocks = dag(20)
    gate = threading.Event()
    fed: list[bytes] = []

    def slow_disk(cid, data, payload):
        gate.wait(10)
        fed.append(data)

    checker = _Checker(verifier, slow_disk)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(checker.run)
            try:
                for data in blocks:
                    await checker.put(data)
            finally:
                checker.close(abort=True)  # a deadline or a failure: what is queued is not checked
                gate.set()
    assert len(fed) < len(blocks) and not verifier.done


def test_two_threads_putting_the_same_block_at_once_both_succeed(tmp_path) -> None:
    """Concurrent puts of one block (a fetch's checker thread and an add) must not rename each other's temp file."""
    import threading

    from agent.content.blockstore import BlockStore
    from protocol.cid import CID, RAW

    store = BlockStore(tmp_path / "blocks")
    blocks = [bytes([i]) * 4096 for i in range(64)]
    cids = [CID.for_block(b, RAW) for b in blocks]
    errors: list[BaseException] = []

    def put_all() -> None:
        try:
            for cid, data in zip(cids, blocks):
                store.put(cid, data)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=put_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(store.get(cid) == data for cid, data in zip(cids, blocks))
