"""The GPU-only checks of issue 11 in one run: train, replay across workers, drift and tokens/s.

On a machine with a CUDA GPU and torch/transformers/peft installed (no hub access needed):
  1. builds a random-weight model of Qwen2.5-0.5B's shape from its config, in code (the tiny
     model's tokenizer; ids stay below the vocabulary), saved as bf16 safetensors;
  2. for each case -- peft bf16, qlora (nf4 + bf16 compute; needs bitsandbytes), unsloth (only if
     importable) -- trains the same shard as two workers (A and B, separate runs), replays one
     segment of A as a verifier would (verify_segment), and measures A against B;
  3. prints JSON lines ``{"bench", "value", "unit", "reference", "ratio", "goal"}`` (ratio higher =
     better): tokens/s against a bare torch + peft loop (goal 0.95; for unsloth, ``gpu_unsloth_vs_peft``:
     against the worker's peft backend on the same device, goal 1.5); replay and run-to-run drift
     (max relative L2 over adapter tensors) against the dtype's tolerance (ratio = tolerance /
     drift, goal 1.0: the tolerance holds with room to spare when the ratio is far above 1).
  4. with two or more CUDA devices, the ``ddp`` case: one worker training data-parallel over all of them
     (agent/train/parallel.py, NCCL) against one process, a one-process replay of its last segment,
     and its scaling (tokens/s against N x one process, goal 0.8).
These drift figures are the ones IPIP-0005 §8.1 asks for. ``--cpu-smoke`` runs the same code on
the tiny model on the CPU in float32 (peft, qlora if bitsandbytes has a CPU backend, ddp over 2 gloo
processes), to check
the script itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

def build_model(out: Path, *, smoke: bool) -> Path:
    """A random-weight model directory: Qwen2.5-0.5B's shape (or the tiny model for --cpu-smoke)."""
    from agent.train.tiny import tiny_model
    from scripts.bench_train import build_shape_model

    return tiny_model() if smoke else build_shape_model(out, "qwen2.5-0.5b")


def max_drift(a_dir: Path, b_dir: Path) -> float:
    from safetensors.torch import load_file

    from agent.train.replay import relative_l2

    a = load_file(str(a_dir / "adapter_model.safetensors"))
    b = load_file(str(b_dir / "adapter_model.safetensors"))
    return max(relative_l2(b, a).values())


def emit(bench: str, value: float, unit: str, reference: float, ratio: float, goal: float, **extra) -> None:
    print(json.dumps({"bench": bench, "value": value, "unit": unit, "reference": reference,
                      "ratio": round(ratio, 4), "goal": goal, **extra}), flush=True)


def replay_last_segment(result, shard: Path, config):
    """Replay ``result``'s last proof segment as a verifier would: (verdict, tolerance, replay drift, segment)."""
    from agent.train.recorder import checkpoint_name
    from agent.train.replay import verify_segment
    from protocol.proof import FP32_TOLERANCE, HALF_TOLERANCE, Commitment

    commitment = Commitment.from_json(json.loads((result.run_dir / "proof.json").read_text()))
    index = len(commitment.links) - 1
    start = result.run_dir / "checkpoints" / checkpoint_name(commitment.segment_start(index)[0])
    end = result.run_dir / "checkpoints" / checkpoint_name(commitment.links[index].step)
    verdict = verify_segment(commitment, index, start=start, end=end, shard=shard, config=config)
    dtype = result.environment.get("dtype", "float32")
    tolerance = config.tolerance or (FP32_TOLERANCE if dtype == "float32" else HALF_TOLERANCE)
    return verdict, tolerance, 0.0 if verdict.exact else verdict.max_distance, index


def run_case(name: str, config, shard: Path, work: Path, backend_name: str, device: str,
             peft_rates: dict[str, float]) -> None:
    """Two workers' runs of one case, a replay of A's last segment, and the case's speed: a peft case against
    a bare torch + peft loop (goal 0.95: the worker's recording costs little); unsloth against the worker's
    peft backend on the same model, config and device (goal 1.5), the peft case's rate from ``peft_rates``
    (keyed by method), else measured here."""
    from agent.train.backends import PeftBackend, UnslothBackend
    from agent.train.run import TrainRequest
    from scripts.bench_train import bare_loop

    backend = UnslothBackend() if backend_name == "unsloth" else PeftBackend()
    results = []
    for worker in ("A", "B"):
        request = TrainRequest(config, shard, work / name / worker, worker=f"worker-{worker}")
        results.append(backend.train(request))
    a, b = results
    verdict, tolerance, replay, index = replay_last_segment(a, shard, config)
    run_to_run = max_drift(a.adapter_dir, b.adapter_dir)
    env = {k: a.environment.get(k) for k in ("device", "device_class", "dtype", "quantization", "backend")}
    rate = b.tokens_per_second  # one run against one run: B's, warm (CUDA context and kernels loaded by A's)
    if backend_name == "unsloth":
        peft = peft_rates.get(config.method)
        if peft is None:
            peft_config = config.with_(runtime="peft")
            peft = PeftBackend().train(TrainRequest(peft_config, shard, work / name / "peft")).tokens_per_second
        emit(f"gpu_{name}_vs_peft_tokens_per_s", round(rate, 1), "tokens/s", round(peft, 1), rate / peft, 1.5,
             env=env)
    else:
        peft_rates.setdefault(config.method, rate)
        tokens, seconds = bare_loop(config.with_(device=device), shard)
        bare = tokens / seconds
        emit(f"gpu_{name}_tokens_per_s", round(rate, 1), "tokens/s", round(bare, 1), rate / bare, 0.95, env=env)
    emit(f"gpu_{name}_replay_drift", replay, "rel_l2", tolerance, tolerance / max(replay, 1e-8), 1.0,
         accepted=verdict.accepted, exact=verdict.exact, segment=index, env=env)
    emit(f"gpu_{name}_run_to_run_drift", run_to_run, "rel_l2", tolerance, tolerance / max(run_to_run, 1e-8), 1.0,
         env=env)


def run_parallel_case(config, shard: Path, work: Path, processes: int) -> None:
    """One worker, ``processes`` GPUs (agent/train/parallel.py): the data-parallel run against one process
    with the same micro-batch split, a one-process replay of its last segment, and its scaling."""
    from agent.train.backends import PeftBackend
    from agent.train.parallel import DataParallelBackend, split_for
    from agent.train.run import TrainRequest

    config = split_for(config, processes)
    name = f"ddp{processes}"
    single = PeftBackend().train(TrainRequest(config, shard, work / name / "single", worker="worker-1"))
    ddp = DataParallelBackend(processes).train(TrainRequest(config, shard, work / name / "ddp", worker="worker-N"))
    verdict, tolerance, replay, index = replay_last_segment(ddp, shard, config)
    drift = max_drift(single.adapter_dir, ddp.adapter_dir)
    env = {k: ddp.environment.get(k) for k in ("device", "device_class", "dtype", "micro_batch", "data_parallel")}
    # scaling: tokens/s of N processes against N times one process (goal 0.8)
    emit(f"gpu_{name}_scaling", round(ddp.tokens_per_second, 1), "tokens/s", round(processes * single.tokens_per_second, 1),
         ddp.tokens_per_second / (processes * single.tokens_per_second), 0.8, env=env)
    emit(f"gpu_{name}_replay_drift", replay, "rel_l2", tolerance, tolerance / max(replay, 1e-8), 1.0,
         accepted=verdict.accepted, exact=verdict.exact, segment=index, env=env)
    emit(f"gpu_{name}_vs_one_process_drift", drift, "rel_l2", tolerance, tolerance / max(drift, 1e-8), 1.0, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU: check the script itself")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--only", nargs="*", default=None, help="cases to run: peft_bf16 qlora unsloth ddp")
    parser.add_argument("--processes", type=int, default=0,
                        help="data-parallel processes for the ddp case (default: every CUDA device; 2 with --cpu-smoke)")
    args = parser.parse_args(argv)

    import importlib.util

    import torch

    from agent.train.config import TrainConfig
    from agent.train.data import split_dataset, write_chatml
    from agent.train.tiny import demo_records

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run with --cpu-smoke to check the script on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if smoke else "cuda"
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model = build_model(work / "qwen2.5-0.5b-shape", smoke=smoke)
    records = demo_records(400, seed=0)
    shard = work / "shard.jsonl"
    write_chatml(shard, [records[i] for i in split_dataset(len(records), 2, 0.0, seed=0).shards[0]])
    steps = min(args.steps, 6) if smoke else args.steps
    config = TrainConfig(
        base_model=str(model), seed=1, batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-3, rank=8,
        alpha=16.0, dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), max_steps=steps,
        checkpoint_every=max(steps // 2, 1), threads=1, log_every=steps, max_seq_len=128, device=device,
        dtype="float32" if smoke else "bfloat16",
    )
    cases = [("peft_bf16" if not smoke else "peft_fp32", config, "peft")]
    if importlib.util.find_spec("bitsandbytes") is not None:
        cases.append(("qlora", config.with_(method="qlora"), "peft"))
    from agent.hardware import unsloth_installed

    if not smoke and unsloth_installed():
        cases.append(("unsloth", config.with_(runtime="unsloth"), "unsloth"))
    elif not smoke and (not args.only or "unsloth" in args.only):
        print(json.dumps({"bench": "gpu_unsloth", "skipped": "unsloth is not installed in this Python "
                          "(scripts/gpu_wheels.sh unsloth carries it)"}), flush=True)
    if importlib.util.find_spec("bitsandbytes") is None and not smoke and (not args.only or "qlora" in args.only):
        print(json.dumps({"bench": "gpu_qlora", "skipped": "bitsandbytes is not installed in this Python "
                          "(scripts/gpu_wheels.sh qlora carries it)"}), flush=True)
    started = time.time()
    peft_rates: dict[str, float] = {}  # the peft worker's tokens/s per method, the reference of the unsloth case
    for name, case_config, backend in cases:
        if args.only and name not in args.only and name.replace("fp32", "bf16") not in args.only:
            continue
        try:
            run_case(name, case_config, shard, work, backend, device, peft_rates)
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others' figures
            print(json.dumps({"bench": f"gpu_{name}", "error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
    processes = args.processes or (2 if smoke else torch.cuda.device_count())
    if processes > 1 and (not args.only or "ddp" in args.only):
        try:
            run_parallel_case(config, shard, work, processes)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"bench": f"gpu_ddp{processes}", "error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
    elif processes <= 1:
        print(json.dumps({"bench": "gpu_ddp", "skipped": "one CUDA device: the multi-GPU case needs two or more"}),
              flush=True)
    print(json.dumps({"bench": "gpu_check_seconds", "value": round(time.time() - started, 1), "unit": "s",
                      "device": torch.cuda.get_device_name() if not smoke else "cpu"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
