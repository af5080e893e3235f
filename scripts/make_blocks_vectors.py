"""Write ipips/vectors/blocks-request.json (IPIP-0003 §4, §4.2, protocol/blocks.py: the /infernet/blocks request,
1.0.0 and 1.1.0); reviewed by hand. Run from the repository root."""
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from protocol import blocks  # noqa: E402
from protocol.cid import parse_cid  # noqa: E402
from protocol.codec import canonical_encode  # noqa: E402
from protocol.errors import CodecError  # noqa: E402

A = "bafkreifjjcie6lypi6ny7amxnfftagclbuxndqonfipmb64f2km2devei4"
B = "bafybeicpoou5cksiss3i7x73c4trort2wvdzu7ctawt645xp5md5hscixy"
WELL_FORMED = [  # (name, wants, wait_ms, shallow)
    ("one CID", [A], 0, False),
    ("two CIDs, in order", [A, B], 0, False),
    ("a wait (1.1.0)", [A, B], 2000, False),
    ("the root alone (1.1.0)", [B], 0, True),
]
MALFORMED = [  # (name, body as a Python value, protocol)
    ("no 'want'", {"wait": 5}, blocks.PROTOCOL_WAIT),
    ("an empty 'want'", {"want": []}, blocks.PROTOCOL),
    ("a 'want' entry that is text", {"want": [A]}, blocks.PROTOCOL),
    ("'wait' on 1.0.0", {"want": [parse_cid(A).to_bytes()], "wait": 5}, blocks.PROTOCOL),
    ("'shallow' on 1.0.0", {"want": [parse_cid(A).to_bytes()], "shallow": True}, blocks.PROTOCOL),
    ("'wait' over the limit", {"want": [parse_cid(A).to_bytes()], "wait": blocks.MAX_WAIT_MS + 1},
     blocks.PROTOCOL_WAIT),
    ("'wait' that is a boolean", {"want": [parse_cid(A).to_bytes()], "wait": True}, blocks.PROTOCOL_WAIT),
    ("'shallow' that is a number", {"want": [parse_cid(A).to_bytes()], "shallow": 1}, blocks.PROTOCOL_WAIT),
    ("an unknown key", {"want": [parse_cid(A).to_bytes()], "depth": 0}, blocks.PROTOCOL_WAIT),
]


def main() -> None:
    well = []
    for name, wants, wait, shallow in WELL_FORMED:
        wire = blocks.encode_request([parse_cid(c) for c in wants], wait, shallow)
        body = wire[1:] if wire[0] < 0x80 else wire[2:]
        for protocol in (blocks.PROTOCOL, blocks.PROTOCOL_WAIT):
            try:
                got = blocks.parse_request(body, protocol)
                read = {"wants": [str(c) for c in got.wants], "wait_ms": got.wait_ms, "shallow": got.shallow}
            except CodecError:
                read = None
            well.append({"name": name, "protocol": protocol, "wire_hex": wire.hex(), "read": read})
    bad = [{"name": name, "protocol": protocol, "body_hex": canonical_encode(value).hex()}
           for name, value, protocol in MALFORMED]
    doc = {
        "description": "IPIP-0003 §4 and §4.2: the /infernet/blocks request. 'well_formed': a request as sent "
                       "(uvarint length, then the canonical msgpack body) and what each protocol reads from its "
                       "body: wanted CIDs, wait in ms, shallow; null: that protocol refuses it (1.0.0 knows neither "
                       "'wait' nor 'shallow'). 'malformed': bodies both protocols or the one named must refuse. "
                       "'wire_hex' and 'read' are normative.",
        "well_formed": well, "malformed": bad,
    }
    Path("ipips/vectors/blocks-request.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
