"""The ledger sync's cost (IPIP-0008 §5.1): what one sync with one peer costs a job's agents once the job's
chains hold ``--entries`` entries (4 authors, each holding copies of the others), in the steady state an
agent's 10-second sync loop meets: the client holds what the server holds but for ``--new`` entries.

Prints one JSON object per figure:
  ledger_sync_seconds  the server's and the client's CPU for one such sync over /infernet/ledger/1.1.0 (the
                       client names what it holds, the server sends the rest, the client checks it against
                       the hashes of its copy), against the same sync over 1.0.0 as agents did it before
                       (every entry sent and checked, the client's copy decoded and checked again), both
                       measured here; ratio = 1.0.0 / 1.1.0 (the speedup), goal 10.
  ledger_sync_entries  entries sent by the server, against 1.0.0's; ratio = 1.0.0 / 1.1.0, goal 10.
Both on real SQLite stores, real Ed25519 signatures; no network (the wire's bytes are the entries sent).
Usage: python scripts/bench_ledger.py [--entries 8000] [--new 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.ledger_sync import absorb, frames_for, served_chains  # noqa: E402
from agent.store import Store  # noqa: E402
from protocol.codec import decode_canonical  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from protocol.ledger import compare_chain  # noqa: E402

JOB = bytes(range(32))


def old_absorb(store: Store, chains: dict, server: str) -> int:
    """1.0.0's client side as agents ran it: every held copy decoded and checked again, compared whole."""
    added = 0
    for author, served in chains.items():
        conflict, new = compare_chain(store.ledger_copy(JOB, author), served, author, server)
        assert conflict is None
        added += store.extend_copy(JOB, author, new)
    return added


def one_sync(server: Store, client: Store, incremental: bool) -> tuple[float, int]:
    started = time.process_time()
    frames = frames_for(server, JOB, client.chain_heads(JOB) if incremental else None)
    pairs = [tuple(decode_canonical(data)) for data in frames]
    chains, invalid = served_chains(pairs, JOB, server.identity.peer_id)
    assert not invalid
    if incremental:
        assert not absorb(client, JOB, chains, server.identity.peer_id, 1.0)[1]
    else:
        old_absorb(client, chains, server.identity.peer_id)
    return time.process_time() - started, len(frames)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=8000)
    parser.add_argument("--new", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    ids = [Identity(bytes([i + 1]) * 32) for i in range(4)]
    stores = [Store(work / f"agent{i}" / "agent.sqlite3", ids[i]) for i in range(4)]
    for i, store in enumerate(stores):
        for k in range(args.entries // 4):
            store.append_event(JOB, "checkpoint", {"round": 1 + k // 50, "shard": i, "attempt": 1, "step": k, "loss": 1.0},
                               10.0 + k)
    for store in stores:  # every agent holds every chain
        for other in stores:
            if other is not store:
                chains, _ = served_chains([(e.encoded, e.signature) for e in other.ledger(JOB)], JOB, "peer")
                absorb(store, JOB, chains, "peer", 1.0)
    server, client = stores[0], stores[1]
    times: dict[bool, list[float]] = {True: [], False: []}
    sent: dict[bool, int] = {}
    step = args.entries
    for repeat in range(args.repeats):
        for incremental in (False, True):
            for _ in range(args.new):  # the server's chain grew since the client's last sync
                server.append_event(JOB, "checkpoint", {"round": 999, "shard": 0, "attempt": 1, "step": step, "loss": 1.0},
                                    99.0)
                step += 1
            seconds, frames = one_sync(server, client, incremental)
            times[incremental].append(seconds)
            sent[incremental] = frames
    new, old = min(times[True]), min(times[False])
    common = {"entries": args.entries, "new": args.new, "authors": 4}
    print(json.dumps({"bench": "ledger_sync_seconds", "value": round(new, 4), "unit": "s", "reference": round(old, 4),
                      "ratio": round(old / new, 1), "goal": 10, **common}), flush=True)
    print(json.dumps({"bench": "ledger_sync_entries", "value": sent[True], "unit": "entries", "reference": sent[False],
                      "ratio": round(sent[False] / max(sent[True], 1), 1), "goal": 10, **common}), flush=True)
    for store in stores:
        store.close()


if __name__ == "__main__":
    main()
