"""Issue 22 (1): no agent dies from its own message, nor because one of its service tasks raised.

Seen on an H100: the GPU workers measured 78.7 GB free against a declared 24 GB total; the capability
failed our own check (``vram_free_gb: expected 0..vram_total_gb``) inside the heartbeat task, the error
escaped every nursery and ended every agent of the network. Here a real worker declares that very GPU,
and then its heartbeat task fails outright once: it stays up, its peers keep hearing it, the failure is
logged and counted (``task_restarts``).
"""

from __future__ import annotations

import pytest
import trio

from agent import hardware
from protocol import messages as m
from tests.roles.conftest import network

pytestmark = pytest.mark.network


async def test_an_agent_outlives_a_capability_outside_the_rules_and_a_failing_service(tmp_path, tiny_model_dir):
    h100 = hardware.Machine("declared CPU", 2, 16.0, (m.Device("cuda", 0, "Declared GPU", 24.0, 78.7, "9.0", True),))
    async with network(tmp_path, tiny_model_dir, workers=1, machines={0: h100}) as net:
        w0, submitter = net.workers[0], net.submitter
        with trio.fail_after(10):  # its capability went out, its free memory within the declared total
            while (info := submitter.peers.get(w0.peer_id)) is None or info.capability is None:
                await trio.sleep(0.1)
        device = info.capability.devices[0]
        assert (device.vram_total_gb, device.vram_free_gb) == (24.0, 24.0)

        publish, failed_at = w0.publish, []

        async def fails_once(message):
            if isinstance(message, m.Heartbeat) and not failed_at:
                failed_at.append(submitter.clock())
                raise RuntimeError("injected: the heartbeat task fails")
            await publish(message)

        w0.publish = fails_once
        with trio.fail_after(15):  # the heartbeats start again (1 s backoff) and reach the submitter
            while not failed_at or submitter.peers[w0.peer_id].last_heartbeat < failed_at[0] + 0.5:
                await trio.sleep(0.1)
        assert w0.counters["task_restarts"] == 1
        assert w0.peer_id in submitter.live_peers() and net.running("w0")
