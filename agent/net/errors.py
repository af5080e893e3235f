"""Errors of the network layer.

Each message is the one line a user sees: it names what was wrong and where (the config field and
the offending value, the peer, the protocol).
"""

from __future__ import annotations


class NetError(Exception):
    """Base of every error raised by ``agent.net``."""


class NetConfigError(NetError):
    """A network setting is invalid (bad multiaddr, missing /p2p/ peer ID, ...)."""


class ProtocolNotSupported(NetError):
    """The peer answered protocol negotiation (multistream-select) with "na": it does not speak it."""


class PeerProtocolError(NetError):
    """A peer broke one of our stream protocols: oversize length prefix, truncated frame, bad request."""
