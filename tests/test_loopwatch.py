"""The event-loop watch names a stall and the code that caused it (agent/loopwatch.py)."""

import logging
import time

import trio

from agent.loopwatch import LoopWatch


def _blocking_work(seconds: float) -> None:
    time.sleep(seconds)  # synchronous work on the event loop: what the watch is for


async def test_a_blocked_loop_is_logged_with_the_blocking_code(caplog):
    watch = LoopWatch(stall=0.6)
    caplog.set_level(logging.WARNING, logger="agent.loopwatch")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(0.6)
        assert watch.stalls == 0 and watch.lag_max < 0.6  # an idle loop beats on time
        _blocking_work(1.6)
        await trio.sleep(0.6)
        nursery.cancel_scope.cancel()
    assert watch.stalls == 1 and 1.0 < watch.lag_max < 3.0
    messages = [r.getMessage() for r in caplog.records]
    during = [m for m in messages if "has been blocked" in m]
    assert during and "_blocking_work" in during[0]  # the stack at the stall names the culprit
    assert any("was blocked for" in m for m in messages)
    assert any(getattr(r, "loop_blocked_s", 0) > 1.0 for r in caplog.records)
