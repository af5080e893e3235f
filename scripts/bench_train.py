"""Benchmark the worker's training backend and the cost of verifying it, on the tiny model.

Prints one JSON object per figure:
  train_tokens_per_s      the peft backend (train_shard: seeded LoRA, deterministic steps, proof
                          recorder with checkpoints and hashing) against a bare torch + peft loop
                          on the same model, examples, batches, steps and threads; goal ratio >= 0.95.
  replay_segment_seconds  verify_segment of one segment (load, hash checks, re-run, compare) against
                          the time the worker spent training that segment; ratio = train / replay
                          (higher is better, as everywhere), goal 0.8 (a replay within 1.25x).
Both sides run in this process, alternately, best of ``--repeats``: the machine is shared and
the first run pays for lazy imports. ``--device cuda`` runs both sides on the GPU (bf16 where it
is supported; ``--model DIR`` for a larger model than the tiny one).
Usage: python scripts/bench_train.py [--steps 60] [--threads 1] [--device cpu|cuda] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", type=Path, default=None, help="base model directory (default: the tiny model)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train: --device cuda but no CUDA GPU is available")

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
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

    worker, bare = max(worker_rates), max(bare_rates)
    print(json.dumps({"bench": "train_tokens_per_s", "value": round(worker, 1), "unit": "tokens/s",
                      "reference": round(bare, 1), "ratio": round(worker / bare, 3), "goal": 0.95,
                      "threads": args.threads, "device": args.device}))
    replay, train = min(replays, key=lambda pair: pair[0] / pair[1])
    print(json.dumps({"bench": "replay_segment_seconds", "value": round(replay, 3), "unit": "s",
                      "reference": round(train, 3), "ratio": round(train / replay, 3), "goal": 0.8,
                      "threads": args.threads, "segment_steps": args.checkpoint_every}))


if __name__ == "__main__":
    main()
