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


def test_a_stopped_process_is_not_taken_for_a_blocked_loop(caplog):
    """SIGSTOP stops the watching thread too: the gap is counted as a suspension, without a stack."""
    import os
    import signal
    import subprocess
    import sys

    code = """
import logging, os, signal, sys, time, trio
sys.path.insert(0, os.getcwd())
from agent.loopwatch import LoopWatch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
async def main():
    watch = LoopWatch(stall=0.6)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        print("ready", flush=True)
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    print("stalls", watch.stalls, "suspensions", watch.suspensions, flush=True)
trio.run(main)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(child.pid, signal.SIGSTOP)
    time.sleep(1.5)
    os.kill(child.pid, signal.SIGCONT)
    out, _ = child.communicate(timeout=30)
    assert "stalls 0 suspensions 1" in out, out
    assert "has been blocked" not in out and "did not run for" in out
