#!/usr/bin/env bash
# The GPU-only checks of issue 11, in one call, for a session that has a CUDA GPU.
#
# Needs torch (CUDA build), transformers and peft preinstalled (bitsandbytes for qlora, unsloth
# optional); no hub access: the model is built in code. Prints JSON lines
#   {"bench": NAME, "value": X, "unit": U, "reference": R, "ratio": X/R (higher = better), "goal": G}
# Usage: scripts/gpu_check.sh [PYTHON]   (default: python3; run from anywhere)
# Steps:
#   1. the real hardware detection on this machine (agent/hardware.py) and the capability it signs;
#   2. the GPU tests that skip on CPU machines, and the CPU tests of this issue on the GPU machine;
#   3. scripts/gpu_check.py: a random-weight Qwen2.5-0.5B-shape model, two workers' training with peft
#      bf16, then qlora, then unsloth if importable; replay across them; drift and tokens/s; with two
#      or more GPUs, one worker data-parallel over all of them (NCCL, agent/train/parallel.py) against
#      one process, replayed in one process, and its scaling;
#   4. scripts/bench_train.py --device cuda on the tiny model (worker vs bare loop, replay cost).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

echo '{"step": "detect"}'
"$PY" - <<'PYEOF' || status=1
import json
from agent import hardware
machine = hardware.detect()
print(json.dumps({"bench": "detect", "cpu": machine.cpu_model, "threads": machine.cpu_threads,
                  "ram_gb": machine.ram_gb, "runtimes": list(hardware.runtimes(machine)),
                  "devices": [d.to_wire() for d in machine.devices],
                  "hardware": hardware.summary(machine).to_wire()}))
assert machine.cuda, "no CUDA device detected"
PYEOF

echo '{"step": "tests"}'
"$PY" -m pytest -q -x tests/test_hardware.py tests/protocol/test_fit.py tests/train/test_presets.py \
    tests/train/test_qlora.py tests/train/test_parallel.py tests/roles/test_gpu_jobs.py 2>&1 | tail -5 || status=1

echo '{"step": "gpu_check"}'
"$PY" scripts/gpu_check.py --steps 40 || status=1

echo '{"step": "multi_gpu"}'
# the worker's data-parallel path through real agents (gloo on the CPU; on a machine with two or more
# GPUs the worker's ranks use NCCL); the NCCL figures themselves come from gpu_check.py's ddp case above
"$PY" -m pytest -q -x -m slow tests/train/test_data_parallel.py tests/roles/test_data_parallel_worker.py \
    2>&1 | tail -3 || status=1

echo '{"step": "bench_train"}'
"$PY" scripts/bench_train.py --device cuda --steps 40 --repeats 2 || status=1

exit $status
