"""The protocol test harness: a deterministic network simulator of the job protocol (``sim``).

It drives the protocol/ state machines and election rules with virtual time, a modelled network
and modelled training; no libp2p, no torch, no real clock. ``scripts/simulate.py`` is its command
line, ``ipips/0009-simulation.md`` the model. The decoder fuzzer is ``scripts/fuzz_decoders.py``.
"""
