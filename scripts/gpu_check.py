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

from scripts.bench_train import PROJECTIONS  # noqa: E402


def build_model(out: Path, *, smoke: bool) -> Path:
    """A random-weight model directory: Qwen2.5-0.5B's shape (or the tiny model for --cpu-smoke)."""
    from agent.train.tiny import tiny_model
    from scripts.bench_train import build_shape_model

    return tiny_model() if smoke else build_shape_model(out, "qwen2.5-0.5b")


def model_parameters(model_dir: Path) -> int:
    """Parameters of the base model (each tensor once: a tied LM head is the embedding), from its headers."""
    import struct
    from math import prod

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        total += sum(prod(info["shape"]) for key, info in header.items() if key != "__metadata__")
    return total


def max_drift(a_dir: Path, b_dir: Path) -> float:
    from safetensors.torch import load_file

    from agent.train.replay import relative_l2

    a = load_file(str(a_dir / "adapter_model.safetensors"))
    b = load_file(str(b_dir / "adapter_model.safetensors"))
    return max(relative_l2(b, a).values())


def emit(bench: str, value: float, unit: str, reference: float, ratio: float, goal: float, **extra) -> None:
    print(json.dumps({"bench": bench, "value": value, "unit": unit, "reference": reference,
                      "ratio": round(ratio, 4), "goal": goal, **extra}), flush=True)


def replay_last_segment(result, shard: Path, config, runtime: str | None = None):
    """Replay ``result``'s last proof segment as a verifier would (``runtime``: None, the verifier's choice;
    "peft" or "unsloth" to force one): (verdict, tolerance, replay drift, segment)."""
    from agent.train.recorder import checkpoint_name
    from agent.train.replay import verify_segment
    from protocol.proof import FP32_TOLERANCE, HALF_TOLERANCE, Commitment

    if runtime == "unsloth":  # the verifier's own choice picks unsloth (its warm child) where it can run
        from agent.train.backends import unsloth_usable

        if not unsloth_usable():
            raise RuntimeError("replay by unsloth asked for, but unsloth is not usable here")
        runtime = None
    commitment = Commitment.from_json(json.loads((result.run_dir / "proof.json").read_text()))
    index = len(commitment.links) - 1
    start = result.run_dir / "checkpoints" / checkpoint_name(commitment.segment_start(index)[0])
    end = result.run_dir / "checkpoints" / checkpoint_name(commitment.links[index].step)
    verdict = verify_segment(commitment, index, start=start, end=end, shard=shard, config=config,
                             round_start=result.run_dir / "checkpoints" / checkpoint_name(0), runtime=runtime)
    dtype = result.environment.get("dtype", "float32")
    tolerance = config.tolerance or (FP32_TOLERANCE if dtype == "float32" else HALF_TOLERANCE)
    return verdict, tolerance, 0.0 if verdict.exact else verdict.max_distance, index


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "RTX 4090": 165e12}
"""Dense bf16 tensor-core peaks (vendor figures, no sparsity), for the MFU column; matched on the device name."""


def mfu(tokens_per_s: float, parameters: int, device_name: str) -> float | None:
    """Model FLOP utilisation of LoRA training: 4 N tokens/s (forward 2N + activation gradients 2N; no weight
    gradients for the frozen base; N counts every parameter once, the tied LM head included) over the peak."""
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)
    return None if peak is None else 4 * parameters * tokens_per_s / peak


def timed_train(backend, request):
    started = time.perf_counter()
    result = backend.train(request)
    return result, time.perf_counter() - started


def run_case(name: str, config, shard: Path, work: Path, backend_name: str, device: str,
             peft_rates: dict[str, float], parameters: int = 0) -> None:
    """Two workers' runs of one case (A first, then B: B's rate is the warm, steady one), a replay of A's
    last segment, and the case's speed: a peft case against a bare torch + peft loop at the same shape (goal
    0.95: the worker's recording costs little), with its MFU; unsloth against the worker's peft backend on the
    same model, config and device (goal 1.5; the peft rate from ``peft_rates`` keyed by the case's shape, else
    measured here), its warm-up (A's wall time over B's: unsloth's import, patching and compile, paid once per
    warm child), and its last segment replayed twice: by unsloth (what a verifier with unsloth does) and by
    peft (what one without it would do: the cross-runtime drift IPIP-0005 §8.1 states)."""
    from agent.train.backends import PeftBackend, UnslothBackend, warm_child
    from agent.train.run import TrainRequest
    from scripts.bench_train import bare_loop

    backend = UnslothBackend() if backend_name == "unsloth" else PeftBackend()
    if config.objective == "dpo" or config.method == "full":  # no stock loop to hold them to: their own rows
        return run_kind_case(name, config, shard, work, backend, peft_rates, parameters)
    (a, a_wall), (b, b_wall) = (timed_train(backend, TrainRequest(config, shard, work / name / worker,
                                                                   worker=f"worker-{worker}")) for worker in "AB")
    env = {k: a.environment.get(k) for k in ("device", "device_class", "dtype", "quantization", "backend", "micro_batch")}
    shape = {"samples_per_step": config.samples_per_step, "max_seq_len": config.max_seq_len, "packing": config.packing,
             "tokens_per_step": round(b.tokens / max(b.steps, 1))}
    rate = b.tokens_per_second  # B's: warm (CUDA context and kernels loaded by A's)
    key = (config.max_seq_len, config.packing, config.samples_per_step, config.method)
    if backend_name == "unsloth":
        peft = peft_rates.get(key)
        if peft is None:
            peft = PeftBackend().train(TrainRequest(config.with_(runtime="peft"), shard, work / name / "peft")).tokens_per_second
        emit(f"gpu_{name}_vs_peft_tokens_per_s", round(rate, 1), "tokens/s", round(peft, 1), rate / peft, 1.5,
             env=env, shape=shape)
        emit(f"gpu_{name}_warmup_s", round(a_wall - b_wall, 1), "s", round(b_wall, 1), b_wall / max(a_wall, 1e-9), 0.5,
             first_request_s=round(a_wall, 1), warm_request_s=round(b_wall, 1),
             child_processes=warm_child(backend.python).started)
    else:
        peft_rates.setdefault(key, rate)
        # the reference is stock peft as anyone runs it: torch's default (non-deterministic) algorithms, not the
        # strict mode our sessions set for the whole process (IPIP-0005 §8.2); call 2 of 2026-11-27 ran it under
        # the worker's settings and its figure was not comparable
        import torch

        mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        torch.use_deterministic_algorithms(False)
        try:
            tokens, seconds = bare_loop(config.with_(device=device), shard)
        finally:
            torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
        bare = tokens / seconds
        utilisation = mfu(rate, parameters, env["device"] or "")
        emit(f"gpu_{name}_tokens_per_s", round(rate, 1), "tokens/s", round(bare, 1), rate / bare, 0.95, env=env,
             shape=shape, mfu=None if utilisation is None else round(utilisation, 4),
             bare_mfu=None if utilisation is None else round(utilisation * bare / rate, 4))
        # the same bare loop under the worker's own determinism (IPIP-0005 §8.2, what the process runs in now):
        # worker against it is what the recording, hashing and checkpointing cost; it against the stock loop is
        # what exact replay costs
        tokens, seconds = bare_loop(config.with_(device=device), shard)
        strict = tokens / seconds
        emit(f"gpu_{name}_vs_bare_same_mode_tokens_per_s", round(rate, 1), "tokens/s", round(strict, 1), rate / strict,
             0.95, env=env, deterministic=torch.are_deterministic_algorithms_enabled(),
             warn_only=torch.is_deterministic_algorithms_warn_only_enabled())
        emit(f"gpu_{name}_determinism_speed", round(strict, 1), "tokens/s", round(bare, 1), strict / bare, 0.9, env=env)
    runtimes = ("unsloth", "peft") if backend_name == "unsloth" else (None,)
    for runtime in runtimes:
        verdict, tolerance, replay, index = replay_last_segment(a, shard, config, runtime)
        label = f"gpu_{name}_replay_drift" + (f"_by_{runtime}" if runtime else "")
        emit(label, replay, "rel_l2", tolerance, tolerance / max(replay, 1e-8), 1.0,
             accepted=verdict.accepted, exact=verdict.exact, segment=index, reason=verdict.reason[:200], env=env)
    run_to_run = max_drift(a.adapter_dir, b.adapter_dir)
    emit(f"gpu_{name}_run_to_run_drift", run_to_run, "rel_l2", 1e-2, 1e-2 / max(run_to_run, 1e-8), 1.0, env=env)


def run_kind_case(name: str, config, shard: Path, work: Path, backend, peft_rates: dict[str, float],
                  parameters: int) -> None:
    """A DPO or a full fine-tuning case (issue 26): two workers' runs, a replay of A's last segment, and the
    speed. DPO against the peft SFT case of the same shape (goal 0.7: each pair adds a reference forward
    without gradients, about a third more work a token); full fine-tuning against a LoRA run of the same model
    and config (goal 0.5: the weights' gradients and AdamW over every weight), with its MFU (6 N a token)."""
    from agent.train.run import TrainRequest

    a, b = (backend.train(TrainRequest(config, shard, work / name / worker, worker=f"worker-{worker}")) for worker in "AB")
    env = {k: a.environment.get(k) for k in ("device", "device_class", "dtype", "backend", "micro_batch")}
    rate = b.tokens_per_second
    if config.method == "full":
        lora = backend.train(TrainRequest(config.with_(method="lora", target_modules=PROJECTIONS, freeze_a=True),
                                          shard, work / name / "lora")).tokens_per_second
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in (env["device"] or "")), None)
        emit(f"gpu_{name}_vs_lora_tokens_per_s", round(rate, 1), "tokens/s", round(lora, 1), rate / lora, 0.5, env=env,
             parameters=parameters, mfu=None if peak is None else round(6 * parameters * rate / peak, 4))
    else:
        sft = peft_rates.get((config.max_seq_len, config.packing, config.samples_per_step, config.method))
        if sft is None:
            sft = backend.train(TrainRequest(config.with_(objective="sft"), shard, work / name / "sft")).tokens_per_second
        emit(f"gpu_{name}_vs_sft_tokens_per_s", round(rate, 1), "tokens/s", round(sft, 1), rate / sft, 0.7, env=env)
    verdict, tolerance, replay, index = replay_last_segment(a, shard, config)
    emit(f"gpu_{name}_replay_drift", replay, "rel_l2", tolerance, tolerance / max(replay, 1e-8), 1.0,
         accepted=verdict.accepted, exact=verdict.exact, segment=index, reason=verdict.reason[:200], env=env)
    run_to_run = max_drift(a.adapter_dir, b.adapter_dir)
    emit(f"gpu_{name}_run_to_run_drift", run_to_run, "rel_l2", 1e-2, 1e-2 / max(run_to_run, 1e-8), 1.0, env=env)


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
    parser.add_argument("--only", nargs="*", default=None,
                        help="cases to run: peft_bf16 packed qlora unsloth unsloth_packed dpo full ddp")
    parser.add_argument("--packed-len", type=int, default=1024, help="tokens per packed sequence (packed cases)")
    parser.add_argument("--packed-batch", type=int, default=16, help="packed sequences per optimizer step")
    parser.add_argument("--packed-steps", type=int, default=20, help="optimizer steps of the packed cases")
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
    # the packed GPU shape (issue 22 §5): sequences packed to --packed-len tokens, --packed-batch of them a step,
    # every projection; the worker's micro-batch is its own choice from its free VRAM (presets.auto_micro_batch)
    packed_shard = work / "packed.jsonl"
    write_chatml(packed_shard, demo_records(300 if smoke else 8000, seed=1))
    packed_steps = min(args.packed_steps, 4) if smoke else args.packed_steps
    packed = config.with_(packing=True, max_seq_len=64 if smoke else args.packed_len,
                          batch_size=4 if smoke else args.packed_batch, gradient_accumulation_steps=1,
                          target_modules=PROJECTIONS, max_steps=packed_steps,
                          checkpoint_every=max(packed_steps // 2, 1), log_every=packed_steps)
    if not smoke:
        from agent.train.presets import auto_micro_batch

        free = torch.cuda.mem_get_info()[0] / (1 << 30)
        packed = packed.with_(micro_batch_size=auto_micro_batch(packed, free, model).micro_batch)
        # the small cases too, as a GPU worker does (agent/roles/worker.py): the 2026-11-27 run split their steps as
        # the spec's batch_size (2 micro-batches of 4) where a worker runs 1 of 8, against a bare loop of 8
        config = config.with_(micro_batch_size=auto_micro_batch(config, free, model).micro_batch)
    # a DPO job's preference pairs, and full fine-tuning of a model within its size limit (issue 26)
    from agent.train.preference import demo_preferences

    preference_shard = work / "preferences.jsonl"
    write_chatml(preference_shard, demo_preferences(200, seed=0))
    if smoke:
        full_model = model
    else:
        from scripts.bench_train import build_shape_model

        full_model = build_shape_model(work / "full-71m", "full-71m")
    full = config.with_(base_model=str(full_model), method="full", freeze_a=False, learning_rate=1e-4)
    cases = [("peft_bf16" if not smoke else "peft_fp32", config, "peft", shard),
             ("packed", packed, "peft", packed_shard),
             ("dpo", config.with_(objective="dpo"), "peft", preference_shard),
             ("full", full, "peft", shard)]
    if importlib.util.find_spec("bitsandbytes") is not None:
        cases.append(("qlora", config.with_(method="qlora"), "peft", shard))
    from agent.hardware import unsloth_installed

    if not smoke and unsloth_installed():
        cases.append(("unsloth", config.with_(runtime="unsloth"), "unsloth", shard))
        cases.append(("unsloth_packed", packed.with_(runtime="unsloth"), "unsloth", packed_shard))
    elif not smoke and (not args.only or "unsloth" in args.only):
        print(json.dumps({"bench": "gpu_unsloth", "skipped": "unsloth is not installed in this Python "
                          "(scripts/gpu_wheels.sh unsloth carries it)"}), flush=True)
    if importlib.util.find_spec("bitsandbytes") is None and not smoke and (not args.only or "qlora" in args.only):
        print(json.dumps({"bench": "gpu_qlora", "skipped": "bitsandbytes is not installed in this Python "
                          "(scripts/gpu_wheels.sh qlora carries it)"}), flush=True)
    started = time.time()
    peft_rates: dict = {}  # the peft worker's tokens/s per shape, the reference of the unsloth cases
    for name, case_config, backend, case_shard in cases:
        if args.only and name not in args.only and name.replace("fp32", "bf16") not in args.only:
            continue
        case_started = time.time()
        if backend == "unsloth" and not smoke:  # the unsloth child needs the memory this process keeps
            import gc

            from agent.train.run import POOL

            POOL.clear()
            gc.collect()
            torch.cuda.empty_cache()
        try:
            run_case(name, case_config, case_shard, work, backend, device, peft_rates,
                     model_parameters(Path(case_config.base_model)))
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others' figures
            import traceback

            traceback.print_exc()
            print(json.dumps({"bench": f"gpu_{name}", "error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
        print(json.dumps({"bench": f"gpu_{name}_case_seconds", "seconds": round(time.time() - case_started, 1)}),
              flush=True)
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
