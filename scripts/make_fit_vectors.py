"""Write ipips/vectors/fit-lease.json (IPIP-0004 §5.1: does a claimant's capability fit the job at lease
time?); reviewed by hand. Run from the repository root."""
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, ".")
from protocol import messages as m  # noqa: E402
from protocol.fit import lease_refusals  # noqa: E402
from protocol.identity import Identity  # noqa: E402
from scripts.make_envelope_vectors import sample_capability, sample_terms  # noqa: E402

MODEL_A = bytes(range(32)).hex()
MODEL_B = bytes([0xEE]) * 32


def capability(peer: dict) -> m.Capability:
    """sample_capability() with the fields a case lists replaced."""
    devices = tuple(m.Device("cuda", i, f"GPU {i}", total, free, "9.0", True)
                    for i, (total, free) in enumerate(peer["cuda_total_free_gb"]))
    return replace(sample_capability(), accepts_training=peer["accepts_training"], backends=tuple(peer["backends"]),
                   devices=devices, models=tuple(m.ModelHeld("m", bytes.fromhex(h)) for h in peer["models"]))


def terms(job: dict) -> m.JobTerms:
    return replace(sample_terms(Identity(bytes([1]) * 32)), base_model_sha256=bytes.fromhex(job["base_model_sha256"]),
                   runtime=job["runtime"], min_vram_gb=job["min_vram_gb"])


def peer(accepts=True, backends=("peft",), gpus=(), models=(MODEL_A,)) -> dict:
    return {"accepts_training": accepts, "backends": list(backends),
            "cuda_total_free_gb": [list(g) for g in gpus], "models": list(models)}


def job(runtime="peft", min_vram=0.0, model=MODEL_A) -> dict:
    return {"runtime": runtime, "min_vram_gb": min_vram, "base_model_sha256": model}


CASES = [
    ("a CPU peer, a CPU peft job", peer(), job()),
    ("no capability heard from the claimant", None, job()),
    ("the capability says it does not train", peer(accepts=False), job()),
    ("the base model is not held by hash", peer(models=(MODEL_B.hex(),)), job()),
    ("a GPU job, a CPU peer", peer(), job(min_vram=16.0)),
    ("a GPU job: one 24 GB device fits 16 GB though only 2 GB is free now (total, not free)",
     peer(gpus=((24.0, 2.0),)), job(min_vram=16.0)),
    ("a GPU job: two 16 GB devices do not make 24 GB (per device)", peer(gpus=((16.0, 16.0), (16.0, 16.0))),
     job(min_vram=24.0)),
    ("unsloth on a CPU peer", peer(), job(runtime="unsloth")),
    ("unsloth on a GPU peer that does not offer it", peer(gpus=((80.0, 80.0),)), job(runtime="unsloth")),
    ("unsloth on a GPU peer that offers it", peer(backends=("peft", "unsloth"), gpus=((80.0, 80.0),)),
     job(runtime="unsloth", min_vram=40.0)),
    ("every unmet requirement is its own reason", peer(accepts=False, models=()), job(runtime="unsloth", min_vram=8.0)),
]


def main() -> None:
    cases = []
    for name, p, j in CASES:
        reasons = lease_refusals(capability(p) if p is not None else None, terms(j))
        cases.append({"name": name, "peer": p, "job": j, "grant": not reasons, "refusals": len(reasons),
                      "reasons": reasons})
    doc = {
        "description": "IPIP-0004 §5.1 lease-time fit: a coordinator grants a lease only to a claimant whose latest "
                       "signed capability exists (peer null: none heard), says accepts_training, offers the job's "
                       "runtime, holds the base model by sha256, and, when min_vram_gb > 0, has one CUDA device whose "
                       "TOTAL memory is >= min_vram_gb (devices listed as [total, free] GB). Each peer is "
                       "scripts/make_envelope_vectors.sample_capability() with those fields replaced; each job is "
                       "sample_terms(Identity(0x01 * 32)) with base_model_sha256, runtime and min_vram_gb replaced. "
                       "'grant' and 'refusals' (how many unmet requirements) are normative; 'reasons' is not.",
        "cases": cases,
    }
    Path("ipips/vectors/fit-lease.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
