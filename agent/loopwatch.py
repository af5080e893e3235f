"""A watch on the agent's event loop: how long it was blocked, and by what.

Every network wait of the agent has a deadline of a few seconds (a stream opens within 10 s, a
request is answered within its own limit). A loop blocked by synchronous work misses all of them at
once, for every peer, and to those peers the agent looks dead. The 30-minute soak logged 1,688
"no stream within 10 s" across 10 agents without saying whose loop, if any, was stalled.

``LoopWatch`` answers that. A task in the loop beats every ``BEAT`` seconds; a daemon thread checks
the beat every ``CHECK`` seconds. When the beat is older than ``STALL`` seconds the thread writes
one warning with the loop thread's stack at that moment (the code that blocks it), and when the loop
beats again one line with how long the stall lasted. The worst lag and the number of stalls are
served as metrics (``infernet_event_loop_lag_seconds_max``, ``infernet_event_loop_stalls_total``).
The thread only reads; it never touches trio or the agent's state.

A gap the watching thread sees in its *own* looks is not the loop's fault: the whole process was
stopped (SIGSTOP, a suspended VM) or got no CPU. The soak's first run with this watch logged 14
"stalls", each during a freeze it injected, with the loop caught at a random harmless line. Such a
gap is counted apart (``suspensions``), logged at info, and no stack is taken.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

import trio

log = logging.getLogger(__name__)

BEAT = 0.25  # seconds between the loop's beats
CHECK = 0.5  # seconds between the watching thread's looks
STALL = 3.0  # a beat this late is a stall: logged with the stack that blocks the loop
STACK_LINES = 12  # innermost frames of the stack written with a stall


class LoopWatch:
    def __init__(self, stall: float = STALL) -> None:
        self.stall = stall
        self.lag_max = 0.0  # the worst gap between two beats, seconds (beyond BEAT)
        self.stalls = 0  # gaps longer than ``stall``
        self._beat = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stalled_since: float | None = None  # set by the watching thread, cleared by the loop
        self._stop = threading.Event()
        self.suspensions = 0  # gaps in which the whole process did not run (not counted as stalls)
        self._suspended_at = float("-inf")  # when the watching thread last found itself late
        self._looked = float("-inf")  # when the watching thread last looked

    async def run(self) -> None:
        """The loop's half: beat until cancelled; the watching thread lives as long as this task."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        watcher = threading.Thread(target=self._watch, name="infernet-loopwatch", daemon=True)
        watcher.start()
        try:
            while True:
                await trio.sleep(BEAT)
                now = time.monotonic()
                lag = now - self._beat - BEAT
                self._beat = now
                if lag > self.stall:  # let the watching thread look once since: it alone tells a stopped
                    # process from a blocked loop, and after a SIGCONT either thread may run first (CI saw
                    # the loop decide before the thread had looked, and count a stop as a stall)
                    give_up = now + 2 * CHECK
                    while self._looked < now and time.monotonic() < give_up:
                        await trio.sleep(0.05)
                if lag > self.stall and self._suspended_at > now - lag - BEAT:
                    self.suspensions += 1  # the process was stopped or starved, the loop with it
                    log.info("the process did not run for %.1f s (stopped or starved of CPU)", lag + BEAT)
                elif lag > self.stall:
                    self.stalls += 1
                    self.lag_max = max(self.lag_max, lag)
                    log.warning("the event loop was blocked for %.1f s (every network deadline of that time "
                                "was missed)", lag + BEAT, extra={"loop_blocked_s": round(lag + BEAT, 2)})
                else:
                    self.lag_max = max(self.lag_max, lag)
                self._stalled_since = None
        finally:
            self._stop.set()

    def _watch(self) -> None:
        looked = time.monotonic()
        while not self._stop.wait(CHECK):
            now = time.monotonic()
            if now - looked > CHECK + self.stall / 2:  # this thread was not running either: the process was not
                self._suspended_at = now
            looked = self._looked = now
            beat = self._beat
            late = now - beat
            if late > self.stall + BEAT and self._stalled_since != beat and self._suspended_at < beat:
                self._stalled_since = beat  # one stack per stall
                frame = sys._current_frames().get(self._loop_thread)
                stack = "".join(traceback.format_stack(frame)[-STACK_LINES:]) if frame is not None else "?"
                log.warning("the event loop has been blocked for %.1f s, in:\n%s", late, stack.rstrip())
