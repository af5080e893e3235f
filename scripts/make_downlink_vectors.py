"""Write ipips/vectors/downlink.json (IPIP-0006 §2.8.1, protocol/downlink.py and agent/downlink.py): which rounds'
aggregates are coded, and one small round: its start (adapter and AdamW state), its combined state, and the coded
aggregate and update payload the coordinator writes from them (every tensor as float32 values, the payload's codes
as bytes in hex). Reviewed by hand; run from the repository root. The coding itself is IPIP-0006 §2.8's, whose
vectors (ipips/vectors/codec.json) come from an encoder written from the text in numpy."""
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, ".")
from agent.downlink import code_aggregate  # noqa: E402
from agent.train.codec import PAYLOAD_FILE  # noqa: E402
from protocol.downlink import coded, update_base  # noqa: E402

OUT = Path("ipips/vectors/downlink.json")
CODED = [  # (name, aggregate_codec, method, rounds, round)
    ("round 1: its start is the seeded adapter", "int4-fresh", "lora", 4, 1),
    ("round 2 of 4", "int4-fresh", "lora", 4, 2),
    ("round 3 of 4", "int8", "qlora", 4, 3),
    ("the last round: the job's result travels whole", "int4-fresh", "lora", 4, 4),
    ("a job of 2 rounds: none", "int4-fresh", "lora", 2, 2),
    ("aggregate_codec none", "none", "lora", 4, 2),
    ("full fine-tuning (refused by the terms; never coded)", "int8", "full", 4, 2),
]
KEYS = ["m.lora_A.weight", "m.lora_B.weight"]
BASE = [  # (name, aggregate_codec, rounds, the rounds whose aggregates are published, round)
    ("round 3's update decodes onto round 2's aggregate", "int4-fresh", 5, [1, 2], 3),
    ("round 2's onto round 1's", "int4-fresh", 5, [1], 2),
    ("round 2's start not known here: fetched whole", "int4-fresh", 5, [], 2),
    ("the last round is not coded", "int4-fresh", 5, [1, 2, 3, 4], 5),
    ("aggregate_codec none", "none", 5, [1, 2], 3),
]


def aggregate_cid(rnd: int) -> str:
    """A stand-in for round ``rnd``'s published aggregate CID in the ``base`` cases."""
    return f"aggregate-r{rnd}"


def terms(codec: str, method: str = "lora", rounds: int = 4):
    return SimpleNamespace(method=method, rounds=rounds,
                           training=SimpleNamespace(aggregate_codec=codec, optimizer_state="carried"),
                           lora=SimpleNamespace(freeze_a=True))


def listed(tensors: dict) -> dict:
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                "values": [float(x) for x in t.reshape(-1).tolist()]} for k, t in sorted(tensors.items())}


def sample_round() -> dict:
    g = torch.Generator().manual_seed(11)
    a = torch.randn(2, 64, generator=g)
    start = {KEYS[0]: a, KEYS[1]: torch.randn(64, 2, generator=g) * 0.01}
    combined = {KEYS[0]: a.clone(), KEYS[1]: start[KEYS[1]] + torch.randn(64, 2, generator=g) * 0.003}
    start_opt, combined_opt = {}, {}
    for key, t in start.items():
        start_opt[f"{key}.exp_avg"] = torch.randn(t.shape, generator=g) * 1e-3
        start_opt[f"{key}.exp_avg_sq"] = torch.rand(t.shape, generator=g) * 1e-6
        start_opt[f"{key}.step"] = torch.tensor(12.0)
        combined_opt[f"{key}.exp_avg"] = torch.randn(t.shape, generator=g) * 1e-3
        combined_opt[f"{key}.exp_avg_sq"] = start_opt[f"{key}.exp_avg_sq"] * 0.99 + torch.rand(t.shape, generator=g) * 1e-7
        combined_opt[f"{key}.step"] = torch.tensor(24.0)
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        out, update = Path(tmp) / "aggregate", Path(tmp) / "update"
        out.mkdir()
        save_file(combined, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        save_file(combined_opt, str(out / "optimizer.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text("{}\n")
        code_aggregate(terms("int4-fresh"), out, update, start, start_opt)
        adapter, optimizer = load_file(str(out / "adapter_model.safetensors")), load_file(str(out / "optimizer.safetensors"))
        payload = load_file(str(update / PAYLOAD_FILE))
    return {"codec": "int4-fresh", "freeze_a": True, "optimizer_state": "carried",
            "start": {"adapter": listed(start), "optimizer": listed(start_opt)},
            "combined": {"adapter": listed(combined), "optimizer": listed(combined_opt)},
            "payload": {k: {"dtype": str(t.dtype).removeprefix("torch."), "hex": t.contiguous().numpy().tobytes().hex()}
                        for k, t in sorted(payload.items())},
            "aggregate": {"adapter": listed(adapter), "optimizer": listed(optimizer)}}


def main() -> None:
    doc = {
        "description": "IPIP-0006 §2.8.1: coded = is round `round`'s aggregate coded (and published with an update); "
                       "base = the aggregate CID its update decodes onto (published: the rounds whose aggregates "
                       "are known, each named aggregate-r<k>; null: fetched whole); "
                       "round: the coordinator's coded aggregate and update payload from a start and a combined state "
                       "(lora_A frozen: left out of the payload, kept as the start's)",
        "coded": [{"name": n, "aggregate_codec": c, "method": m, "rounds": r, "round": rnd,
                   "coded": coded(terms(c, m, r), rnd)} for n, c, m, r, rnd in CODED],
        "base": [{"name": n, "aggregate_codec": c, "rounds": r, "published": p, "round": rnd,
                  "base": update_base(terms(c, "lora", r), {k: SimpleNamespace(adapter_cid=aggregate_cid(k)) for k in p},
                                      rnd)} for n, c, r, p, rnd in BASE],
        "round": sample_round(),
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
