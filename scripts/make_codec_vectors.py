"""Generate ipips/vectors/codec.json (IPIP-0006 §2.8: coded reports) with an encoder written
from the rule in numpy, independently of agent/train/codec.py, then check the codec agrees.

Each case: a tensor's values (float32, as hex of their little-endian bytes), its kind (`signed`:
an adapter delta or exp_avg; `root`: an exp_avg_sq; `root-log`: an exp_avg_sq under int4-log, its root
on a log scale; `root-fresh`: an exp_avg_sq under int4-fresh, with the round's start `start` (hex, as
`values`) and `steps` n: what the round added, u = max(v - BETA2^n * start, 0), coded as `root-log`, decoded
to BETA2^n * start + u'), the bits per code (8: int8, 4: int4, int4-log and int4-fresh), the
codes (before 4-bit packing) and block scales the rule gives, the stored `.q` bytes (hex), and the
sha256 of the decoded float32 values' bytes.
Run from the repository root: python scripts/make_codec_vectors.py
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 64


def blocks(x: np.ndarray) -> np.ndarray:
    flat = np.zeros(-(-x.size // BLOCK) * BLOCK, dtype=np.float32)
    flat[:x.size] = x.reshape(-1)
    return flat.reshape(-1, BLOCK)


def signed(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    top = 2 ** (bits - 1) - 1
    b = blocks(x)
    scale = (np.abs(b).max(axis=1) / np.float32(top)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    q = np.clip(np.round(b / safe[:, None]), -top, top).astype(np.int8)
    decoded = (q.astype(np.float32) * scale[:, None]).reshape(-1)[:x.size]
    return q.reshape(-1), scale, decoded


def root(v: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    top = 2 ** bits - 1
    r = np.sqrt(np.maximum(blocks(v), np.float32(0)).astype(np.float64)).astype(np.float32)
    scale = (r.max(axis=1) / np.float32(top)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    q = np.clip(np.round(r / safe[:, None]), 0, top)
    q = np.where(r > 0, np.maximum(q, 1), q).astype(np.uint8)
    d = q.astype(np.float32) * scale[:, None]
    return q.reshape(-1), scale, (d * d).reshape(-1)[:v.size]


def root_log(v: np.ndarray, bits: int = 4, step: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int4-log's root: scale = the block's largest root; code q > 0 stands for scale * 2^(-(top - q) * step);
    a positive root codes to 1 + the number of thresholds scale * 2^(-(top - q) * step - step / 2), q = 2..top,
    it reaches (the geometric midpoints); 0 to 0."""
    top = 2 ** bits - 1
    levels = np.array([2.0 ** (-(top - q) * step) for q in range(1, top + 1)], dtype=np.float64).astype(np.float32)
    between = np.array([2.0 ** (-(top - q) * step - step / 2) for q in range(2, top + 1)],
                       dtype=np.float64).astype(np.float32)
    r = np.sqrt(np.maximum(blocks(v), np.float32(0)).astype(np.float64)).astype(np.float32)
    scale = r.max(axis=1).astype(np.float32)
    thresholds = (scale[:, None, None] * between[None, None, :]).astype(np.float32)
    q = (r[:, :, None] >= thresholds).sum(axis=2) + 1
    q = np.where(r > 0, q, 0).astype(np.uint8)
    table = np.concatenate([np.zeros(1, dtype=np.float32), levels])
    d = (table[q.astype(np.int64)] * scale[:, None]).astype(np.float32)
    return q.reshape(-1), scale, (d * d).reshape(-1)[:v.size]


BETA2 = 0.999  # the inner AdamW's (IPIP-0005 §3)


def root_fresh(v: np.ndarray, start: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int4-fresh's second moment: the decayed start BETA2^n * start (a float64 power rounded to float32, times
    the start in float32) carried as it is; of the rest, u = max(v - that, 0) in float32, root_log's codes."""
    base = (start.astype(np.float32) * np.float32(BETA2 ** steps)).astype(np.float32)
    fresh = np.maximum((v.astype(np.float32) - base).astype(np.float32), np.float32(0))
    q, scale, decoded = root_log(fresh, 4)
    return q, scale, (base + decoded).astype(np.float32)


def cases() -> list[dict]:
    rng = np.random.default_rng(2026)
    out = []
    inputs = [
        ("signed", "a delta of 70 values (two blocks, the second padded)", rng.normal(0, 1e-3, 70)),
        ("signed", "a zero block and a block with one large value", np.concatenate([np.zeros(64), [5.0], rng.normal(0, 1e-4, 63)])),
        ("signed", "halves round to even", np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 58)),
        ("root", "second moments over six decades, zeros and a denormal-small value",
         np.concatenate([rng.random(60) ** 6 * 1e-8, [0.0, 0.0, 1e-30, 1e-8]])),
        ("root", "an all-zero block", np.zeros(64)),
    ]
    for bits in (8, 4):
        for kind, what, values in inputs:
            values = values.astype(np.float32)
            q, scale, decoded = (signed if kind == "signed" else root)(values, bits)
            out.append(case(what, kind, bits, values, q, scale, decoded))
    for _, what, values in inputs[3:]:  # int4-log's root, on the same second moments
        values = values.astype(np.float32)
        out.append(case(what, "root-log", 4, values, *root_log(values, 4)))
    # int4-fresh: a round of 25 steps from a start that holds most of the second moment; and from no start
    start = (rng.random(64) ** 6 * 1e-8).astype(np.float32)
    start[:2] = 0.0
    end = (start * np.float32(BETA2 ** 25) + rng.random(64).astype(np.float32) ** 6 * 1e-10).astype(np.float32)
    end[2] = np.float32(start[2] * np.float32(BETA2 ** 25))  # nothing added: decodes to the decayed start
    for what, v, s0, n in (("a round's second moments over a start holding most of them", end, start, 25),
                           ("round 1: no start (as root-log)", end, np.zeros(64, dtype=np.float32), 25)):
        out.append(dict(case(what, "root-fresh", 4, v, *root_fresh(v, s0, n)),
                        start=s0.astype("<f4").tobytes().hex(), steps=n))
    return out


def case(what: str, kind: str, bits: int, values: np.ndarray, q: np.ndarray, scale: np.ndarray,
         decoded: np.ndarray) -> dict:
    return {"what": what, "kind": kind, "bits": bits, "values": values.astype("<f4").tobytes().hex(),
            "codes": q.astype(int).tolist(), "stored": stored(q, bits, kind == "signed").hex(),
            "scales": scale.astype("<f4").tobytes().hex(),
            "decoded_sha256": hashlib.sha256(decoded.astype("<f4").tobytes()).hexdigest()}


def stored(q: np.ndarray, bits: int, is_signed: bool) -> bytes:
    """The ``.q`` tensor's bytes: 8-bit codes as they are (int8 or uint8); 4-bit codes two to a byte,
    the first in the low nibble, a signed code q as q + 8."""
    if bits == 8:
        return q.astype(np.int8 if is_signed else np.uint8).tobytes()
    nibbles = (q.astype(np.int16) + (8 if is_signed else 0)).astype(np.uint8).reshape(-1, 2)
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).astype(np.uint8).tobytes()


def check(vectors: list[dict]) -> None:
    """agent/train/codec.py must give the same codes, scales and decoded bytes."""
    sys.path.insert(0, str(ROOT))
    import torch

    from agent.train.codec import (
        LOG_ROOT_STEP, _packed, decode_root, decode_root_log, decode_signed, encode_root, encode_root_log, encode_signed,
    )

    step = LOG_ROOT_STEP["int4-log"]
    coders = {"signed": (encode_signed, decode_signed), "root": (encode_root, decode_root),
              "root-log": (lambda x, bits: encode_root_log(x, bits, step),
                           lambda c, s, like: decode_root_log(c, s, like, 4, step))}

    for case in vectors:
        values = torch.from_numpy(np.frombuffer(bytes.fromhex(case["values"]), dtype="<f4").copy())
        if case["kind"] == "root-fresh":
            _check_fresh(case, values)
            continue
        is_signed = case["kind"] == "signed"
        encode, decode = coders[case["kind"]]
        codes, scale = encode(values, case["bits"])
        assert codes.tolist() == case["codes"], case["what"]
        packed, _ = _packed(codes, scale, case["bits"], is_signed)
        assert packed.numpy().tobytes().hex() == case["stored"], case["what"]
        assert scale.numpy().astype("<f4").tobytes().hex() == case["scales"], case["what"]
        decoded = decode(codes, scale, values).numpy().astype("<f4").tobytes()
        assert hashlib.sha256(decoded).hexdigest() == case["decoded_sha256"], case["what"]


def _check_fresh(case: dict, values) -> None:
    """int4-fresh through the codec's own encode/decode of an AdamW state {p.step, p.exp_avg_sq}."""
    import torch

    from agent.train.codec import decode, encode

    start = torch.from_numpy(np.frombuffer(bytes.fromhex(case["start"]), dtype="<f4").copy())
    end_state = {"p.step": torch.tensor(float(100 + case["steps"])), "p.exp_avg_sq": values}
    start_state = {"p.step": torch.tensor(100.0), "p.exp_avg_sq": start}
    payload = encode({}, {}, end_state, [], "int4-fresh", start_state)
    assert payload["optimizer/p.exp_avg_sq.q"].numpy().tobytes().hex() == case["stored"], case["what"]
    assert payload["optimizer/p.exp_avg_sq.scale"].numpy().astype("<f4").tobytes().hex() == case["scales"], case["what"]
    _, state = decode(payload, {}, end_state, [], "int4-fresh", start_state)
    decoded = state["p.exp_avg_sq"].numpy().astype("<f4").tobytes()
    assert hashlib.sha256(decoded).hexdigest() == case["decoded_sha256"], case["what"]


def main() -> None:
    vectors = cases()
    check(vectors)
    path = ROOT / "ipips" / "vectors" / "codec.json"
    path.write_text(json.dumps({"ipip": "0006 §2.8", "block": BLOCK, "cases": vectors}, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}: {len(vectors)} cases, agent/train/codec.py agrees")


if __name__ == "__main__":
    main()
