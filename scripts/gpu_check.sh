#!/usr/bin/env bash
# The GPU-only checks of issue 11, in one call, for a session that has a CUDA GPU (the `device` tool).
#
# The GPU machine has torch (CUDA), transformers, peft, accelerate, pytest ... but not our other
# dependencies, and no registry: they travel as wheels. Once, here (PyPI is reachable here):
#     scripts/gpu_wheels.sh            # -> .whl/ (git-ignored), ~52 MiB: core + bitsandbytes + unsloth
#                                      #    (scripts/gpu_wheels.sh core|qlora for less; see its header)
# Then ONE device call (the model is built in code; nothing is fetched there):
#     run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh all 2>&1 | tee $OUT/gpu_check.log",
#         carry=[".whl"], timeout_s=590)
# and give_back. Each step has its own time cap (the variables below), so a slow step cannot hide the
# others' figures; every line that starts with '{' is a figure or a step marker. If the whole run does not
# fit one call, run the sets separately, core first: `gpu_check.sh core`, then `gpu_check.sh qlora`, then
# `gpu_check.sh unsloth` (each installs .whl/*.whl again: a fresh machine is bare).
#
# Usage: scripts/gpu_check.sh [all|core|qlora|unsloth]   (default all; PYTHON=python3; run from anywhere)
# Prints JSON lines {"bench": NAME, "value": X, "unit": U, "reference": R, "ratio": X/R (higher = better),
# "goal": G}, or {"bench": NAME, "skipped"|"error": "one line"}. Steps, by set:
#   install  (every set) .whl/*.whl into /tmp/site, first on PYTHONPATH after this repository;
#   detect   (every set) the real hardware detection (agent/hardware.py) and the capability it signs;
#   tests    (core, all) the tests of this issue that mean something on a GPU, on the GPU machine;
#   gpu_check (core: peft_bf16 [+ ddp]; qlora: qlora; unsloth: unsloth; all: every case)
#            scripts/gpu_check.py: a random-weight Qwen2.5-0.5B-shape model; two workers' training, a replay
#            of one segment, run-to-run and replay drift, tokens/s (peft/qlora against a bare loop, goal 0.95;
#            unsloth against the worker's peft backend, goal 1.5); with two or more GPUs the ddp case (NCCL);
#   multi_gpu (core, all; only with two or more GPUs) the worker's data-parallel path through real agents;
#   bench_train (core, unsloth, all) scripts/bench_train.py --device cuda --shape qwen2.5-0.5b: the worker vs
#            its bare backend (goal 0.95), replay cost, and with unsloth the unsloth_vs_peft_tokens_per_s row.
set -uo pipefail
cd "$(dirname "$0")/.."
SET="${1:-all}"
case "$SET" in all|core|qlora|unsloth) ;; *) echo "gpu_check: unknown set '$SET' (all, core, qlora or unsloth)" >&2; exit 2;; esac
PY="${PYTHON:-python3}"
T_TESTS="${T_TESTS:-150}" T_GPU_CHECK="${T_GPU_CHECK:-300}" T_MULTI="${T_MULTI:-150}" T_BENCH="${T_BENCH:-150}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
started=$SECONDS
step() { echo "{\"step\": \"$1\", \"set\": \"$SET\", \"elapsed_s\": $((SECONDS - started))}"; }

step install
if compgen -G ".whl/*.whl" >/dev/null; then
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo '{"bench": "install", "error": "pip install of .whl/*.whl failed"}'; exit 1; }
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo '{"bench": "install", "skipped": "no .whl/: run scripts/gpu_wheels.sh where PyPI is reachable and carry .whl"}'
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step detect
"$PY" - <<'PYEOF' || status=1
import importlib.util, json
from agent import hardware
machine = hardware.detect()
print(json.dumps({"bench": "detect", "cpu": machine.cpu_model, "threads": machine.cpu_threads,
                  "ram_gb": machine.ram_gb, "runtimes": list(hardware.runtimes(machine)),
                  "devices": [d.to_wire() for d in machine.devices],
                  "hardware": hardware.summary(machine).to_wire(),
                  "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None}))
if not machine.cuda:
    raise SystemExit('{"bench": "detect", "error": "no CUDA device detected"}')
PYEOF
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

if [ "$SET" = all ] || [ "$SET" = core ]; then
  step tests
  timeout -k 10 "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -rfEs tests/test_hardware.py \
      tests/protocol/test_fit.py tests/train/test_presets.py tests/train/test_qlora.py tests/train/test_parallel.py \
      tests/train/test_train.py::test_backend_selection tests/roles/test_gpu_jobs.py 2>&1 | tail -n 25 || status=1
fi

case "$SET" in
  all) cases="" ;;   # every case gpu_check.py can run here
  core) cases="peft_bf16 ddp" ;;
  *) cases="$SET" ;;
esac
step gpu_check
timeout -k 10 "$T_GPU_CHECK" "$PY" scripts/gpu_check.py --steps 40 ${cases:+--only $cases} || status=1

if { [ "$SET" = all ] || [ "$SET" = core ]; } && [ "$GPUS" -ge 2 ]; then
  step multi_gpu  # the worker's data-parallel path through real agents; its ranks use NCCL on two or more GPUs
  timeout -k 10 "$T_MULTI" "$PY" -m pytest -q -p no:cacheprovider -m slow tests/train/test_data_parallel.py \
      tests/roles/test_data_parallel_worker.py 2>&1 | tail -n 5 || status=1
fi

if [ "$SET" != qlora ]; then
  step bench_train
  runtime=peft
  [ "$SET" = core ] || runtime=unsloth
  timeout -k 10 "$T_BENCH" "$PY" scripts/bench_train.py --device cuda --shape qwen2.5-0.5b --runtime "$runtime" \
      --steps 40 --checkpoint-every 20 --repeats 2 || status=1
fi

step done
exit $status
