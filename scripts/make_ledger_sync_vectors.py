"""Write ipips/vectors/ledger-sync.json (IPIP-0008 §5.1, protocol/ledger.py: what a client asking over
/infernet/ledger/1.1.0 names, and from which seq a server sends each chain it holds); reviewed by hand.
Run from the repository root. Hashes are written as hex; a chain is its entries' hashes in seq order."""
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from protocol.ledger import encode_held, serve_from  # noqa: E402

AUTHOR_A, AUTHOR_B = bytes([0xA1]) * 32, bytes([0xB2]) * 32


def hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + bytes([i])).digest() for i in range(n)]


CHAIN = hashes(5)
FORKED = CHAIN[:3] + hashes(2, b"other")  # the same first three entries, then others
SERVE = [
    ("the client names none of the chain: all of it", CHAIN, None, 0),
    ("the client holds none (length 0): all of it", CHAIN, (0, bytes(32)), 0),
    ("the client holds the first 3, the same: from seq 3", CHAIN, (3, CHAIN[2]), 3),
    ("the client holds all 5: from seq 5 (nothing)", CHAIN, (5, CHAIN[4]), 5),
    ("the server holds fewer (3 of the client's 5): its last entry, seq 2", CHAIN[:3], (5, CHAIN[4]), 2),
    ("the client's head differs at seq 3 (a fork before it): all of it", FORKED, (4, CHAIN[3]), 0),
    ("the client's head differs at seq 4, the server holds 5: all of it", FORKED, (5, CHAIN[4]), 0),
    ("the server holds none of the chain: nothing", [], (2, CHAIN[1]), 0),
]
REQUEST = {AUTHOR_B: (2, CHAIN[1]), AUTHOR_A: (5, CHAIN[4])}


def main() -> None:
    doc = {
        "description": "IPIP-0008 §5.1 incremental ledger sync: the request body a client sends after the job ID "
                       "(one uvarint-length frame: canonical list of [author, length, head hash], sorted by author) "
                       "and serve_from: the seq from which a server sends its copy of a chain (hashes in seq order) "
                       "to a client holding (length, head) of it.",
        "request": {"held": [[a.hex(), n, h.hex()] for a, (n, h) in sorted(REQUEST.items())],
                    "body_hex": encode_held(REQUEST).hex()},
        "serve_from": [{"name": name, "server_hashes": [h.hex() for h in chain],
                        "held": None if held is None else [held[0], held[1].hex()], "start": start}
                       for name, chain, held, start in SERVE],
    }
    for case, (_, chain, held, start) in zip(doc["serve_from"], SERVE):
        assert serve_from(chain, held) == start, case["name"]
    out = Path("ipips/vectors/ledger-sync.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
