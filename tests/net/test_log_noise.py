"""py-libp2p's per-peer failure records stay out of the default log and show at debug level."""

from __future__ import annotations

import io
import json
import logging

import pytest
import trio
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL_ID

from agent.daemon import setup_logging
from tests.net.conftest import agents

NOISE = "Failed to read DHT message from stream"


@pytest.fixture
def restore_logging():
    loggers = [logging.getLogger(), logging.getLogger("libp2p"), logging.getLogger("bitsandbytes")]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, handlers, level, propagate in saved:
        lg.handlers[:], lg.propagate = handlers, propagate
        lg.setLevel(level)


async def _dht_streams_closed_early(rounds: int = 3) -> None:
    """A peer opens Kademlia streams to another and closes them without a message, as peers do."""
    async with agents(2) as (a, b):
        for _ in range(rounds):
            stream = await b.host.open_stream(a.host.peer_id, [str(KAD_PROTOCOL_ID)], timeout=10)
            await stream.close()
        await trio.sleep(0.5)  # the handler's read fails at once; let it log


def _records(log: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in log.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize("verbose", [False, True])
def test_dht_stream_failures_only_at_debug(verbose, restore_logging):
    log = io.StringIO()
    setup_logging(log, verbose=verbose)
    trio.run(_dht_streams_closed_early)
    noise = [r for r in _records(log) if r["msg"].startswith(NOISE)]
    if verbose:
        assert noise and all(r["level"] == "debug" for r in noise)
    else:
        assert noise == [], noise[:2]
