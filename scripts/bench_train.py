"""Benchmark the worker's training backend and the cost of verifying it, on the tiny model.

Prints one JSON object per figure:
  train_tokens_per_s      the peft backend (train_shard: seeded LoRA, deterministic steps, proof
                          recorder with checkpoints and hashing) against a bare torch + peft loop
                          on the same model, examples, batches, steps and threads; goal ratio >= 0.95.
  replay_segment_seconds  verify_segment of one segment (load, hash checks, re-run, compare) against
                          the time the worker spent training that segment; ratio = train / replay
                          (higher is better, as everywhere), goal 0.8 (a replay within 1.25x).
  round_shard_seconds     a worker's whole shard at the demo's round shape (12 steps, a checkpoint every 3,
                          rank 16 on every projection, round 2: the start adapter and its AdamW state
                          loaded from a bundle) from the call to the result: loading, steps, checkpoints,
                          the final adapter; against the bare loop's time for the same 12 steps; ratio =
                          bare / whole (the share of a short round's shard that is training), goal 0.8.
  unsloth_vs_peft_tokens_per_s  (``--runtime unsloth``) the worker's unsloth backend (its child process,
                          agent/train/unsloth_runner.py) against the worker's peft backend above, same
                          model, shard, config and device; ratio = unsloth / peft, goal 1.5. Without a
                          CUDA GPU or without unsloth the row says ``skipped`` with the reason, in one line.
Both sides run in this process, alternately, best of ``--repeats`` (unsloth: best of at most 2, each in
a fresh child): the machine is shared and the first run pays for lazy imports. ``--device cuda`` runs
both sides on the GPU (bf16 where it is supported). The model: the tiny one, ``--model DIR``, or
``--shape qwen2.5-0.5b``: a random-weight model of Qwen2.5-0.5B's shape built in code from its config
(no hub access; the tiny model's tokenizer, whose ids stay below its vocabulary).
Usage: python scripts/bench_train.py [--steps 60] [--threads 1] [--device cpu|cuda]
       [--model DIR | --shape qwen2.5-0.5b] [--runtime peft|unsloth]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from agent.train.config import TrainConfig  # noqa: E402
from agent.train.data import split_dataset, step_samples, write_chatml  # noqa: E402
from agent.train.loop import collate  # noqa: E402
from agent.train.model import load_tokenizer  # noqa: E402
from agent.train.recorder import checkpoint_name  # noqa: E402
from agent.train.replay import verify_segment  # noqa: E402
from agent.train.run import TrainRequest, load_shard, pad_token_id, train_shard  # noqa: E402
from agent.train.tiny import demo_records, tiny_model  # noqa: E402
from protocol.proof import Commitment  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B config.json, the fields that shape the weights
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
)
# a model full fine-tuning may train (at most FULL_MAX_PARAMETERS = 80M): 8 Qwen2 layers of 768, the tiny
# tokenizer's 1024-token vocabulary; about 71M parameters
FULL_71M = dict(vocab_size=1024, hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12,
                num_key_value_heads=4, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, hidden_act="silu")
SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "full-71m": FULL_71M}


def build_shape_model(out: Path, shape: str = "qwen2.5-0.5b") -> Path:
    """A random-weight model directory of ``shape`` (seeded; bf16 safetensors) with the tiny model's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "model.safetensors").exists():
        return out
    tiny = tiny_model()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    return out


def unsloth_unavailable(device: str) -> str | None:
    """Why the unsloth backend cannot run here (one line), or None."""
    from agent.hardware import unsloth_installed

    if device != "cuda" or not torch.cuda.is_available():
        return "runtime unsloth needs a CUDA GPU: run with --device cuda on a machine that has one"
    if not unsloth_installed():
        return "unsloth is not installed in this Python (nor named by INFERNET_UNSLOTH_PYTHON)"
    return None


def unsloth_row(config: TrainConfig, shard: Path, work: Path, peft_rate: float, repeats: int) -> dict:
    """The unsloth_vs_peft_tokens_per_s row: the worker's unsloth backend against its peft backend's tokens/s."""
    from agent.train.backends import UnslothBackend

    row = {"bench": "unsloth_vs_peft_tokens_per_s", "unit": "tokens/s", "goal": 1.5, "device": config.device}
    reason = unsloth_unavailable(config.device)
    if reason is not None:
        return {**row, "skipped": reason}
    rates = []
    try:
        for repeat in range(max(1, min(repeats, 2))):
            request = TrainRequest(config.with_(runtime="unsloth"), shard, work / f"unsloth{repeat}")
            rates.append(UnslothBackend().train(request).tokens_per_second)
    except Exception as exc:  # noqa: BLE001 - one line: the other figures stand
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {**row, "value": round(max(rates), 1), "reference": round(peft_rate, 1),
            "ratio": round(max(rates) / peft_rate, 3)}


def bare_loop(config: TrainConfig, shard: Path) -> tuple[int, float]:
    """The reference: stock peft LoRA, AdamW, the model's own loss, nothing recorded; (tokens, seconds)."""
    from peft import LoraConfig, get_peft_model

    from agent.train.model import load_base_model, pick_device, pick_dtype

    torch.set_num_threads(config.threads)
    tokenizer = load_tokenizer(config.base_model)
    examples = load_shard(config, tokenizer, shard).examples
    device = pick_device(config.device)
    model = load_base_model(config.base_model, device=device, dtype=pick_dtype(config.dtype, device),
                            quantize_4bit=config.method == "qlora")
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                             target_modules=list(config.target_modules), task_type="CAUSAL_LM"))
    for name, parameter in model.named_parameters():
        if config.freeze_a and ".lora_A." in name:
            parameter.requires_grad_(False)  # the same work as the worker: FFA-LoRA trains B only
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    model.train()
    tokens = 0
    started = time.perf_counter()
    for step in range(config.max_steps):
        indices = step_samples(len(examples), config.samples_per_step, config.seed, step)
        batch = collate([examples[i] for i in indices], pad_token_id(tokenizer), device)
        loss = model(**batch).loss
        loss.backward()
        loss.item()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(batch["attention_mask"].sum())
    if device == "cuda":
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - started


def round_shard_row(config: TrainConfig, shard: Path, work: Path, repeats: int) -> dict:
    """``round_shard_seconds``: train_shard of round 2 at the demo's shape, whole, against the bare loop's 12 steps."""
    config = config.with_(max_steps=12, checkpoint_every=3, rank=16, alpha=32.0, carry_optimizer=True, round=1)
    first = train_shard(TrainRequest(config, shard, work / "round1"))
    start = first.adapter_dir  # the round's start as a worker unpacks it: adapter, its config, AdamW state
    config = config.with_(round=2)
    wholes, bares = [], []
    for repeat in range(repeats):
        bares.append(bare_loop(config, shard)[1])
        started = time.perf_counter()
        train_shard(TrainRequest(config, shard, work / f"round2-{repeat}", initial_adapter=start, round=2))
        wholes.append(time.perf_counter() - started)
    whole, bare = min(wholes), min(bares)
    return {"bench": "round_shard_seconds", "value": round(whole, 3), "unit": "s", "reference": round(bare, 3),
            "ratio": round(bare / whole, 3), "goal": 0.8, "steps": 12, "threads": config.threads,
            "device": config.device}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, default=None, help="base model directory (default: the tiny model)")
    model.add_argument("--shape", choices=sorted(SHAPES), default=None,
                       help="a random-weight model of this shape, built in code (no hub access)")
    parser.add_argument("--runtime", choices=("peft", "unsloth"), default="peft",
                        help="unsloth: also the unsloth_vs_peft_tokens_per_s row (needs CUDA and unsloth)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train: --device cuda but no CUDA GPU is available")
    if args.model is not None and not args.model.is_dir():
        raise SystemExit(f"bench_train: --model {args.model}: not a directory")

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    if args.shape:
        args.model = build_shape_model(work / args.shape, args.shape)
    records = demo_records(400, seed=0)
    shard = work / "shard.jsonl"
    write_chatml(shard, [records[i] for i in split_dataset(len(records), 2, 0.0, seed=0).shards[0]])
    config = TrainConfig(
        base_model=str(args.model or tiny_model()), seed=1, batch_size=8, learning_rate=1e-3, rank=8, alpha=16.0,
        dropout=0.0, target_modules=PROJECTIONS, max_steps=args.steps, checkpoint_every=args.checkpoint_every,
        threads=args.threads, log_every=args.steps, max_seq_len=128, device=args.device,
    )

    bare_rates, worker_rates, replays = [], [], []
    for repeat in range(args.repeats):
        tokens, seconds = bare_loop(config, shard)
        bare_rates.append(tokens / seconds)
        stamps: list[float] = []
        request = TrainRequest(config, shard, work / f"run{repeat}")
        started = time.perf_counter()
        result = train_shard(request, lambda event: stamps.append(time.perf_counter()))
        worker_rates.append(result.tokens_per_second)

        # replay the middle segment; its training time is the span between its two checkpoint events
        commitment = Commitment.from_json(json.loads((request.run_dir / "proof.json").read_text()))
        index = len(commitment.links) // 2
        segment_train = stamps[index] - (stamps[index - 1] if index else started + result.load_seconds)
        start_step = commitment.segment_start(index)[0]
        checkpoints = request.run_dir / "checkpoints"
        replay_started = time.perf_counter()
        verdict = verify_segment(commitment, index, start=checkpoints / checkpoint_name(start_step),
                                 shard=shard, config=config)
        replays.append((time.perf_counter() - replay_started, segment_train))
        if not verdict.accepted:
            raise SystemExit(f"replay rejected an honest segment: {verdict}")

    round_shard = round_shard_row(config, shard, work, args.repeats)

    worker, bare = max(worker_rates), max(bare_rates)
    print(json.dumps({"bench": "train_tokens_per_s", "value": round(worker, 1), "unit": "tokens/s",
                      "reference": round(bare, 1), "ratio": round(worker / bare, 3), "goal": 0.95,
                      "threads": args.threads, "device": args.device,
                      "model": args.shape or ("tiny" if args.model is None else str(args.model))}), flush=True)
    replay, train = min(replays, key=lambda pair: pair[0] / pair[1])
    print(json.dumps({"bench": "replay_segment_seconds", "value": round(replay, 3), "unit": "s",
                      "reference": round(train, 3), "ratio": round(train / replay, 3), "goal": 0.8,
                      "threads": args.threads, "segment_steps": args.checkpoint_every}))
    print(json.dumps(round_shard), flush=True)
    if args.runtime == "unsloth":
        print(json.dumps(unsloth_row(config, shard, work, worker, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
