"""Writes ipips/vectors/jobspec-*.json from the cases below; review the output by eye before committing."""
import json
from protocol.jobspec import parse_spec, SpecError

HEAD = "name: demo\nbase_model: ./tiny-model\ninput:\n  dataset: ./train.jsonl\n"  # lines 1-4

valid = [
 ("minimal: the three required keys, everything else default", HEAD),
 ("every key set, flow and block style, 2e-4 and an int for a float, hash lowered", """\
name: chat-lora
base_model: org/base-model
base_model_sha256: 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08
method: qlora
runtime: unsloth
seed: 42
input: {dataset: bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy, format: chatml, validation_split: 0.1}
training:
  epochs: 3
  learning_rate: 2e-4
  batch_size: 8
  gradient_accumulation_steps: 2
  max_seq_len: 1024
  max_steps: 500
lora:
  rank: 16
  alpha: 32
  dropout: 0.05
  target_modules:
    - q_proj
    - k_proj
    - v_proj
    - o_proj
  freeze_a: true
resources: {min_vram_gb: 12, max_runtime_hours: 6.5}
shards: 8
rounds: 3
aggregation: svd
min_accepted_fraction: 0.75
max_retries: 0
proof: {checkpoint_every: 10, verify_segments: 4, tolerance: 0}
lease_seconds: 600
budget: {price_per_hour: 0.5, total: 100}
"""),
 ("freeze_a defaults to false when aggregation is not exact", HEAD + "aggregation: fedavg\n"),
 ("outer optimizer and a cosine schedule with warm-up across rounds", HEAD + "training:\n  schedule: cosine\n  warmup_rounds: 1\nrounds: 8\nouter:\n  optimizer: nesterov\n  lr: 1.5\n  momentum: 0.5\n"),
 ("a Hugging Face dataset as input: name, split, config and revision", "name: demo\nbase_model: ./tiny-model\ninput:\n  hf: HuggingFaceH4/ultrachat_200k\n  split: train_sft\n  revision: \"8049631\"\n"),
 ("a packed GPU job: examples concatenated into 1024-token sequences", HEAD + "training:\n  max_seq_len: 1024\n  packing: true\nresources:\n  min_vram_gb: 16\n"),
 ("a DPO job: preference records (the format follows the type) and its beta", HEAD + "type: dpo\ndpo:\n  beta: 0.25\n"),
 ("full fine-tuning: aggregation follows the method (fedavg), freeze_a the aggregation", HEAD + "method: full\n"),
 ("every round's start as an update: reports and aggregates coded", HEAD + "training:\n  report_codec: int4-fresh\n  aggregate_codec: int4-fresh\n"),
 ("long rounds after shorter first ones: 25, 25 and 50 steps, then 100 a round", HEAD + "rounds: 6\ntraining:\n  max_steps: 100\n  inner_schedule: triangle\n  first_round_steps: [25, 25, 50]\n"),
 ("robust aggregation with enough accepted shards: ceil(0.6 x 5) = 3", HEAD + "aggregation: trimmed_mean\nshards: 5\nmin_accepted_fraction: 0.6\n"),
 ("YAML 1.2 core scalars: 'no' is text, 1E-3 and .5 are numbers, +3 an integer; null and empty sections", """\
name: no
base_model: off
base_model_sha256: null
input:
  dataset: "./data set.jsonl"   # quoted text
training:
  learning_rate: 1E-3
  epochs: +3
lora:
  dropout: .5
resources:
budget: {}
"""),
]

invalid = [
 ("not YAML", HEAD + "training:\n  epochs: [1\n", ),
 ("tab indentation", HEAD + "training:\n\tepochs: 1\n"),
 ("two documents", HEAD + "---\nname: other\n"),
 ("unprintable character", HEAD + "seed: 1\x07\n"),
 ("top level a list", "- name: demo\n- base_model: x\n"),
 ("top level a scalar", "just some text\n"),
 ("empty document", "# nothing but a comment\n"),
 ("missing top-level key", "name: demo\ninput:\n  dataset: ./train.jsonl\n"),
 ("missing key in a section", "name: demo\nbase_model: m\ninput:\n  format: chatml\n"),
 ("missing section with a required key", "name: demo\nbase_model: m\n"),
 ("section given as a scalar", HEAD + "training: fast\n"),
 ("wrong type: text for a number", HEAD + "training:\n  learning_rate: abc\n"),
 ("wrong type: float for an integer", HEAD + "training:\n  epochs: 2.0\n"),
 ("wrong type: list for a string", "name: [a, b]\nbase_model: m\ninput:\n  dataset: d\n"),
 ("wrong type: mapping for a number", HEAD + "seed: {a: 1}\n"),
 ("wrong type: empty value", HEAD + "training:\n  batch_size:\n"),
 ("wrong type: hex integer", HEAD + "seed: 0x10\n"),
 ("empty string", "name: ''\nbase_model: m\ninput:\n  dataset: d\n"),
 ("multi-line string", "name: \"two\\nlines\"\nbase_model: m\ninput:\n  dataset: d\n"),
 ("string too long", "name: " + "x" * 300 + "\nbase_model: m\ninput:\n  dataset: d\n"),
 ("boolean given as a string", HEAD + "lora:\n  freeze_a: \"true\"\n"),
 ("YAML 1.1 boolean word", HEAD + "lora:\n  freeze_a: yes\n"),
 ("number given as a string", HEAD + "training:\n  epochs: \"3\"\n"),
 ("boolean for an integer", HEAD + "shards: true\n"),
 ("out of range: zero epochs", HEAD + "training:\n  epochs: 0\n"),
 ("out of range: above the maximum", HEAD + "lora:\n  rank: 5000\n"),
 ("out of range: integer with too many digits", HEAD + "seed: 1234567890123456789012345678901234567890\n"),
 ("out of range: negative learning rate", HEAD + "training:\n  learning_rate: -0.1\n"),
 ("out of range: validation_split 0.5", HEAD + "  validation_split: 0.5\n"),
 ("out of range: min_accepted_fraction 0", HEAD + "min_accepted_fraction: 0\n"),
 ("out of range: dropout 1", HEAD + "lora:\n  dropout: 1\n"),
 ("out of range: short lease", HEAD + "lease_seconds: 5\n"),
 ("not finite: .inf", HEAD + "budget:\n  total: .inf\n"),
 ("not finite: .nan", HEAD + "proof:\n  tolerance: .nan\n"),
 ("bad sha256", HEAD + "base_model_sha256: abc123\n"),
 ("bad enum", HEAD + "method: dora\n"),
 ("bad enum, close to an allowed value", HEAD + "aggregation: fedvg\n"),
 ("bad enum, wrong case", HEAD + "runtime: PEFT\n"),
 ("target_modules as a string", HEAD + "lora:\n  target_modules: q_proj\n"),
 ("target_modules empty", HEAD + "lora:\n  target_modules: []\n"),
 ("target_modules item empty", HEAD + "lora:\n  target_modules:\n    - q_proj\n    - ''\n"),
 ("target_modules duplicate", HEAD + "lora:\n  target_modules: [q_proj, v_proj, q_proj]\n"),
 ("unknown key with did-you-mean", HEAD + "training:\n  learnig_rate: 0.001\n"),
 ("unknown top-level key with did-you-mean", HEAD + "agregation: exact\n"),
 ("key in the wrong section", HEAD + "learning_rate: 0.001\n"),
 ("misspelt key of another section", HEAD + "lora_rank: 16\n"),
 ("unknown key, nothing close", HEAD + "proof:\n  zebra: 1\n"),
 ("outer optimizer with a robust aggregation", HEAD + "aggregation: median\nshards: 3\nouter: {optimizer: nesterov}\n"),
 ("outer lr out of range", HEAD + "outer:\n  optimizer: sgd\n  lr: 0\n"),
 ("warm-up as long as the job", HEAD + "rounds: 2\ntraining:\n  warmup_rounds: 2\n"),
 ("bad schedule", HEAD + "training:\n  schedule: linear\n"),
 ("merge key is not special", HEAD + "<<: {seed: 1}\n"),
 ("duplicate key", HEAD + "seed: 1\nseed: 2\n"),
 ("duplicate key in a section", HEAD + "training:\n  epochs: 1\n  batch_size: 2\n  epochs: 3\n"),
 ("duplicate key, one quoted", HEAD + "seed: 1\n\"seed\": 2\n"),
 ("alias", HEAD + "training:\n  epochs: &n 2\n  batch_size: *n\n"),
 ("alias bomb", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"),
 ("too many values", HEAD + "lora:\n  target_modules: [" + ", ".join(["m"] * 2000) + "]\n"),
 ("nesting too deep", HEAD + "seed: " + "[" * 40 + "]" * 40 + "\n"),
 ("python tag", HEAD + "seed: !!python/object/apply:os.system [echo]\n"),
 ("custom tag", HEAD + "seed: !secret 4\n"),
 ("explicit tag that does not fit", HEAD + "seed: !!int four\n"),
 ("non-scalar key", HEAD + "? [a, b]\n: 1\n"),
 ("cross-field: exact aggregation needs freeze_a", HEAD + "aggregation: exact\nlora:\n  freeze_a: false\n"),
 ("cross-field: median needs 3 shards", HEAD + "aggregation: median\nshards: 2\n"),
 ("cross-field: trimmed_mean with too low an accepted fraction", HEAD + "aggregation: trimmed_mean\nshards: 4\nmin_accepted_fraction: 0.5\n"),
 ("dataset ipfs:// that is not a CID", "name: demo\nbase_model: ./tiny-model\ninput:\n  dataset: ipfs://QmNotACid\n"),
 ("description with a control character (wrong type)",
  "name: demo\ndescription: \"bell \\a\"\nbase_model: ./tiny-model\ninput:\n  dataset: ./train.jsonl\n"),
 ("private given as a string (boolean given as a string)",
  "name: demo\nbase_model: ./tiny-model\nprivate: \"true\"\ninput:\n  dataset: ./train.jsonl\n"),
 ("input.dataset and input.hf both given", "name: demo\nbase_model: ./tiny-model\ninput:\n  dataset: ./train.jsonl\n  hf: org/name\n"),
 ("a DPO job given ChatML records", HEAD.replace("input:\n", "type: dpo\ninput:\n  format: chatml\n")),
 ("a DPO job packed", HEAD + "type: dpo\ntraining:\n  packing: true\n"),
 ("dpo.beta of 0", HEAD + "type: dpo\ndpo:\n  beta: 0\n"),
 ("an unknown type", HEAD + "type: grpo\n"),
 ("full fine-tuning with the exact aggregation", HEAD + "method: full\naggregation: exact\n"),
 ("full fine-tuning of a DPO job", HEAD + "method: full\ntype: dpo\n"),
 ("full fine-tuning on unsloth", HEAD + "method: full\nruntime: unsloth\n"),
 ("full fine-tuning with a coded aggregate", HEAD + "method: full\ntraining:\n  aggregate_codec: int8\n"),
 ("an aggregate codec that is not one", HEAD + "training:\n  aggregate_codec: int2\n"),
 ("first rounds' steps without max_steps", HEAD + "rounds: 4\ntraining:\n  first_round_steps: [25]\n"),
 ("first rounds' steps for every round", HEAD + "rounds: 2\ntraining:\n  max_steps: 100\n  first_round_steps: [25, 50]\n"),
 ("a first round of no steps", HEAD + "rounds: 4\ntraining:\n  max_steps: 100\n  first_round_steps: [25, 0]\n"),
 ("first rounds' steps as one number", HEAD + "rounds: 4\ntraining:\n  max_steps: 100\n  first_round_steps: 25\n"),
 ("packing given as a string", HEAD + "training:\n  packing: \"yes\"\n"),
]

def main():
    out_valid = []
    for name, text in valid:
        spec = parse_spec(text, "infernet.train.yml")
        out_valid.append({"name": name, "yaml": text, "canonical": spec.to_dict()})
    out_invalid = []
    for name, text in invalid:
        try:
            parse_spec(text, "infernet.train.yml")
        except SpecError as e:
            out_invalid.append({"name": name, "yaml": text, "error": str(e)})
        else:
            raise SystemExit(f"case {name!r} parsed")
    doc_v = {"description": "Valid job specs (IPIP-0007) and their canonical form, JobSpec.to_dict(). "
             "Parse 'yaml' with source name 'infernet.train.yml'. In 'canonical', numbers written with a "
             "decimal point are floats and must stay floats (they hash differently from ints).",
             "source": "infernet.train.yml", "cases": out_valid}
    doc_i = {"description": "Invalid job specs (IPIP-0007): parsing 'yaml' with source name "
             "'infernet.train.yml' must fail with exactly the one-line 'error'.",
             "source": "infernet.train.yml", "cases": out_invalid}
    for path, doc in (("ipips/vectors/jobspec-valid.json", doc_v), ("ipips/vectors/jobspec-invalid.json", doc_i)):
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, ensure_ascii=True)
            f.write("\n")
    for c in out_invalid:
        print(f"{c['name']:60} | {c['error']}")

main()
