"""Write ipips/vectors/acceptance-report.json (IPIP-0005 §8 report checks R2-R4: header, chain, adapter);
reviewed by hand. Run from the repository root."""
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from protocol.acceptance import (  # noqa: E402
    HEADER_FIELDS, MAX_ABS_VALUE, TensorFacts, adapter_refusal, chain_refusal, header_refusal,
)

HEADER = {"job_id": "aa" * 32, "round": 2, "shard": 1, "attempt": 1, "worker": "12D3KooWworker", "seed": 7,
          "checkpoint_every": 4, "base_model_sha256": "bb" * 32}


def header_cases():
    yield "every field equal", dict(HEADER), dict(HEADER)
    for name in HEADER_FIELDS:
        other = dict(HEADER)
        other[name] = "someone-else" if isinstance(HEADER[name], str) else HEADER[name] + 1
        yield f"{name} differs", other, dict(HEADER)


def chain_cases():
    heads = ["01" * 32, "02" * 32, "03" * 32]
    yield "as reported, through every gossiped head", 3, 3, heads, [[0, heads[0]], [2, heads[2]]]
    yield "no checkpoint at all", 0, 0, [], []
    yield "fewer links than the report says", 3, 2, heads[:2], []
    yield "a gossiped head the chain misses", 3, 3, heads, [[1, "ff" * 32]]
    yield "a gossiped index past the chain", 3, 3, heads, [[5, heads[0]]]


def adapter_cases():
    ok = [["q.lora_A.weight", [4, 16], True, 0.9], ["q.lora_B.weight", [16, 4], True, 0.02]]
    config = {"r": 4, "target_modules": ["v_proj", "q_proj"]}
    yield "the job's adapter", config, ok
    yield "another rank", {"r": 8, "target_modules": ["q_proj", "v_proj"]}, ok
    yield "other target modules", {"r": 4, "target_modules": ["q_proj"]}, ok
    yield "no tensors", config, []
    yield "a factor of another rank", config, [["q.lora_A.weight", [8, 16], True, 0.9]]
    yield "a non-finite value", config, [["q.lora_B.weight", [16, 4], False, 0.0]]
    yield "a value past the bound", config, [["q.lora_B.weight", [16, 4], True, MAX_ABS_VALUE * 2]]
    yield "a value at the bound", config, [["q.lora_B.weight", [16, 4], True, MAX_ABS_VALUE]]


def full_cases():
    weights = [["model.layers.0.self_attn.q_proj.weight", [128, 128], True, 0.3], ["lm_head.weight", [1024, 128], True, 0.9]]
    full = {"infernet_method": "full", "base_model_name_or_path": "tiny"}
    yield "full fine-tuning: the model's weights", full, weights
    yield "full fine-tuning: a LoRA config", {"r": 4, "target_modules": ["q_proj", "v_proj"]}, weights
    yield "full fine-tuning: a LoRA factor among the weights", full, weights + [["q.lora_A.weight", [4, 16], True, 0.9]]
    yield "full fine-tuning: a non-finite weight", full, [["lm_head.weight", [1024, 128], False, 0.0]]
    yield "full fine-tuning: no weights", full, []


def main() -> None:
    cases = []
    for name, header, expected in header_cases():
        refusal = header_refusal(header, expected)
        cases.append({"check": "header", "name": name, "header": header, "expected": expected,
                      "accept": refusal is None, "refusal": refusal})
    for name, reported, links, heads, gossiped in chain_cases():
        refusal = chain_refusal(reported, links, [bytes.fromhex(h) for h in heads],
                                [(i, bytes.fromhex(h)) for i, h in gossiped])
        cases.append({"check": "chain", "name": name, "reported_checkpoints": reported, "links": links,
                      "heads": heads, "gossiped": gossiped, "accept": refusal is None, "refusal": refusal})
    for name, config, tensors in adapter_cases():
        facts = [TensorFacts(t[0], tuple(t[1]), t[2], t[3]) for t in tensors]
        refusal = adapter_refusal(config, facts, 4, ("q_proj", "v_proj"))
        cases.append({"check": "adapter", "name": name, "config": config, "tensors": tensors, "rank": 4,
                      "target_modules": ["q_proj", "v_proj"], "accept": refusal is None, "refusal": refusal})
    for name, config, tensors in full_cases():
        facts = [TensorFacts(t[0], tuple(t[1]), t[2], t[3]) for t in tensors]
        refusal = adapter_refusal(config, facts, 4, ("q_proj", "v_proj"), "full")
        cases.append({"check": "adapter", "name": name, "config": config, "tensors": tensors, "rank": 4,
                      "target_modules": ["q_proj", "v_proj"], "method": "full", "accept": refusal is None,
                      "refusal": refusal})
    doc = {"description": "IPIP-0005 §8 report checks (protocol/acceptance.py): R2 the proof header's fields equal "
                          "the report's and the job's (hex strings stand for bytes); R3 the chain has the reported "
                          "checkpoints and passes through every gossiped head ([index, head]); R4 the adapter's "
                          "config (rank, target modules) and tensors ([name, shape, all finite, largest |x|]) "
                          f"fit the job, |x| <= {MAX_ABS_VALUE:g}; with \"method\": \"full\" (full fine-tuning) the "
                          "config says so and no tensor is a LoRA factor. 'accept' is normative, 'refusal' is not.",
           "max_abs_value": MAX_ABS_VALUE, "cases": cases}
    Path("ipips/vectors/acceptance-report.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
