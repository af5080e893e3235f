"""Which py-libp2p log records are noise to an operator, and the handler filter that demotes them.

py-libp2p logs every transient per-peer failure at WARNING or ERROR: a Kademlia stream the remote
closed ("Failed to read DHT message from stream: ", every refresh, per peer), a stream that could
not be opened to a peer that left, a provider query that failed. In a network of peers these
happen all the time and are handled (the peer is retried or dropped), so they are DEBUG records
for us: shown with ``--verbose``, absent from the default log.

The filter sits on the log HANDLER, not on a logger: a logger's level check happens before its
filters run, so a record relabelled there would still reach a handler without a level. Here the
record is relabelled and then checked against the handler's level.

This module imports only ``logging``, so setting up a log does not load py-libp2p.
"""

from __future__ import annotations

import logging

# message beginnings of py-libp2p's records about one peer's transient failure (checked on
# py-libp2p 0.8.1: kad_dht/kad_dht.py, peer_routing.py, provider_store.py, value_store.py,
# host/basic_host.py)
NOISE_PREFIXES = (
    "Failed to open stream to",          # basic_host (ERROR, multi-line), peer_routing (WARNING)
    "Failed to read DHT message from stream",
    "Incomplete DHT message from stream",
    "Failed to send ADD_PROVIDER to",
    "Error sending ADD_PROVIDER to",
    "Failed to get providers from",
    "Error getting providers from",
    "Failed to store value at peer",
    "Failed to get value from peer",
    "Value not found for key",
)


def is_libp2p_noise(record: logging.LogRecord) -> bool:
    if not record.name.startswith("libp2p"):
        return False
    message = record.msg if isinstance(record.msg, str) else str(record.msg)
    return message.startswith(NOISE_PREFIXES)


class DemoteLibp2pNoise(logging.Filter):
    """Handler filter: py-libp2p's per-peer failure records become DEBUG, then the handler's level applies."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and is_libp2p_noise(record):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return record.levelno >= self.handler.level
