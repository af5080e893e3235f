"""Coded aggregates (IPIP-0006 §2.8.1, spec key ``training.aggregate_codec``): which rounds' aggregates are
coded, what their update holds, and onto which start it decodes.

Rules of this file:
- Pure: the job's terms and a round in, a decision out.
- With ``aggregate_codec`` other than ``none``, the aggregate of round r, for 2 <= r < rounds, is not the
  round's combined state itself but that state passed through the codec from the round's start (the
  previous round's published aggregate): start + decode(encode(combined - start)), its AdamW moments as a
  report's are (agent/train/codec.py). The coordinator publishes that decoded state as the aggregate (so
  the next round trains from it and its proofs commit it, as ever), and beside it the *update*: a bundle of
  the payload (``delta.safetensors``, format ``infernet-update-<codec>/1``), the aggregate's
  ``adapter_config.json`` and, with an outer optimizer, its ``outer_state.safetensors``, whole. It names the
  update's CID in its ``early`` and ``aggregate`` messages (``update_cid``).
- Round 1's aggregate travels whole (its start is the seeded adapter, which is no bundle anyone holds), and
  so does the last round's (the job's result: nobody starts from it); full fine-tuning's always does.
- An update of round r's aggregate decodes onto round r's start, round r - 1's published aggregate
  (``update_base``). A peer holding round r's start rebuilds the aggregate from the update (``UPDATE_FILES``) and checks the
  rebuilt bundle's CID against the announced aggregate's; when they differ, or it lacks the start, it fetches
  the aggregate whole. The CID check is the whole of the trust: a wrong update costs its fetch, nothing else.
The vectors are ``ipips/vectors/downlink.json`` (scripts/make_downlink_vectors.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from protocol.messages import AggregatePublished, JobTerms

UPDATE_FILES = frozenset({"adapter_config.json", "delta.safetensors", "outer_state.safetensors"})
"""The files an update bundle may hold."""


def coded(terms: JobTerms, rnd: int) -> bool:
    """Is round ``rnd``'s aggregate the coded state (and published with an update)?"""
    return terms.training.aggregate_codec != "none" and terms.method != "full" and coded_round(rnd, terms.rounds)


def coded_round(rnd: int, rounds: int) -> bool:
    """Is round ``rnd`` of ``rounds`` one whose aggregate a job with an ``aggregate_codec`` codes? Not round 1 (its
    start is no bundle anyone holds), not the last (the job's result: nobody starts from it)."""
    return 2 <= rnd < rounds


def update_base(terms: JobTerms, aggregates: Mapping[int, AggregatePublished], rnd: int) -> str | None:
    """The CID an update of round ``rnd``'s aggregate decodes onto: round ``rnd``'s start, the published aggregate
    of round ``rnd - 1`` (``aggregates``: a mirror's, by round); None when round ``rnd`` is not coded or that
    aggregate is not known (then the aggregate is fetched whole)."""
    base = aggregates.get(rnd - 1)
    return base.adapter_cid if coded(terms, rnd) and base is not None else None

