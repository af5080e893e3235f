"""Generate ipips/vectors/proof-randomness.json (IPIP-0005 §6, §6.1: the training's randomness) with an
encoder written independently of protocol/proof.py, then check protocol/proof.py agrees.

Run from the repository root: python scripts/make_randomness_vectors.py
"""
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MASK63 = 2**63 - 1


def u64(n):
    return n.to_bytes(8, "little")


def h(*parts):
    return hashlib.sha256(b"".join(parts)).digest()


def epoch(n, seed, e):
    keys = {i: h(b"infernet/epoch/v1\x00", u64(seed), u64(e), u64(i)) for i in range(n)}
    return sorted(range(n), key=keys.__getitem__)


def step(seed, s):
    return int.from_bytes(h(b"infernet/step-rng/v1\x00", u64(seed), u64(s))[:8], "little") & MASK63


def micro(seed, s, j):
    return int.from_bytes(h(b"infernet/micro-rng/v1\x00", u64(seed), u64(s), u64(j))[:8], "little") & MASK63


def lora_a(seed, name):
    return int.from_bytes(h(b"infernet/lora-a/v1\x00", u64(seed), name.encode("utf-8"))[:8], "little")


SEEDS = (0, 1234, 2**64 - 1)
doc = {
    "description": "protocol.proof training randomness (IPIP-0005 §6): epoch_order(n, seed, epoch) -> permutation; "
                   "step_seed(seed, step) and micro_seed(seed, step, micro) -> torch.manual_seed value (63 bits); "
                   "lora_a_seed(seed, module name) -> CPU generator seed (64 bits)",
    "epoch_order": [{"n": n, "seed": seed, "epoch": e, "order": epoch(n, seed, e)}
                    for n, seed, e in [(0, 1234, 0), (1, 1234, 0), (5, 1234, 0), (5, 1234, 1), (10, 0, 0),
                                       (10, 2**64 - 1, 7), (16, 1234, 2)]],
    "step_seed": [{"seed": seed, "step": s, "value": step(seed, s)} for seed in SEEDS for s in (0, 1, 99, 2**40)],
    "micro_seed": [{"seed": seed, "step": s, "micro": j, "value": micro(seed, s, j)}
                   for seed in SEEDS for s in (0, 3) for j in (0, 1, 2)],
    "lora_a_seed": [{"seed": seed, "module": name, "value": lora_a(seed, name)}
                    for seed in (0, 1234) for name in ("model.layers.0.self_attn.q_proj",
                                                       "model.layers.0.self_attn.v_proj", "transformer.h.11.attn.c_attn",
                                                       "blocks.0.ffn.é")],
    "errors": [
        {"rule": "step_seed", "args": [-1, 0], "error": "out of u64 range"},
        {"rule": "step_seed", "args": [2**64, 0], "error": "out of u64 range"},
        {"rule": "micro_seed", "args": [1, 2, -3], "error": "out of u64 range"},
        {"rule": "epoch_order", "args": [-1, 1, 0], "error": "need 0 to 2^32"},
        {"rule": "lora_a_seed", "args": [1, ""], "error": "1 to 1024 UTF-8 bytes"},
    ],
}
out = ROOT / "ipips" / "vectors" / "proof-randomness.json"
out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

sys.path.insert(0, str(ROOT))
from protocol import proof  # noqa: E402
from protocol.errors import ProofError  # noqa: E402

for c in doc["epoch_order"]:
    assert list(proof.epoch_order(c["n"], c["seed"], c["epoch"])) == c["order"], c
for c in doc["step_seed"]:
    assert proof.step_seed(c["seed"], c["step"]) == c["value"], c
for c in doc["micro_seed"]:
    assert proof.micro_seed(c["seed"], c["step"], c["micro"]) == c["value"], c
for c in doc["lora_a_seed"]:
    assert proof.lora_a_seed(c["seed"], c["module"]) == c["value"], c
for c in doc["errors"]:
    try:
        getattr(proof, c["rule"])(*c["args"])
    except ProofError as e:
        assert c["error"] in str(e), (c, e)
    else:
        raise AssertionError(f"{c} raised nothing")
print(f"wrote {out.relative_to(ROOT)}; protocol.proof agrees")
