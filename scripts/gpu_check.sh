#!/usr/bin/env bash
# The GPU-only checks of issues 11 and 22, in two calls, for a session that has a CUDA GPU (the `device` tool).
#
# The GPU machine has torch (CUDA), transformers, peft, accelerate, pytest ... but not our other
# dependencies, and no registry: they travel as wheels. Once, here (PyPI is reachable here):
#     scripts/gpu_wheels.sh            # -> .whl/ (git-ignored), ~47 MiB: core + bitsandbytes + unsloth
#                                      #    (scripts/gpu_wheels.sh core|qlora for less; see its header)
# Then TWO device calls, back to back so the machine stays warm (the model is built in code; nothing is fetched
# there). The device returns at most 8 files of 16 MiB from $OUT, so write into /tmp/gc and copy the logs (the
# network step's directory is ~170 MiB: never under $OUT). On an H200 (2026-11-27) `all` took 436 s with
# unsloth in it and its gpu_check step ran out of time; without unsloth it is ~370 s, and `unsloth` 208 s.
# A session short of device time (15 minutes, the start included) gets the figures that are not met yet in one
# call: CASES="packed qlora unsloth_packed" T_GPU_CHECK=380 ... all took 326 s with the tests and the network
# (2026-11-27, H200). The two-call recipe:
#     run(command="mkdir -p /tmp/gc; timeout 560 bash scripts/gpu_check.sh all --out /tmp/gc > /tmp/gc/outer.log 2>&1;
#                  for f in outer.log tests.log gpu_check.log network.log figures.jsonl summary.txt;
#                  do tail -c 15000000 /tmp/gc/$f > $OUT/$f; done; cat /tmp/gc/summary.txt",
#         carry=[".whl"], timeout_s=595)
#     run(command="mkdir -p /tmp/gu; timeout 330 bash scripts/gpu_check.sh unsloth --out /tmp/gu > /tmp/gu/outer.log 2>&1;
#                  for f in outer.log gpu_check.log figures.jsonl summary.txt; do tail -c 15000000 /tmp/gu/$f > $OUT/$f;
#                  done; cat /tmp/gu/summary.txt", carry=[".whl"], timeout_s=360)
# and give_back. Each step has its own time cap (the variables below), so a slow step cannot hide the
# others' figures; every line that starts with '{' is a figure or a step marker. If the whole run does not
# fit one call, run the sets separately, core first: `gpu_check.sh core`, then `gpu_check.sh qlora`, then
# `gpu_check.sh unsloth` (each installs .whl/*.whl again: a fresh machine is bare).
#
# Usage: scripts/gpu_check.sh [all|core|qlora|unsloth|kinds|bench] [--out DIR]
#   (environment: CASES="..." the gpu_check.py cases instead of the set's; TESTS="..." the test paths;
#    SKIP_NETWORK=1 leaves out the network step: for a second call that re-measures what the first one found)
#   (default all; PYTHON=python3; run from anywhere). Every step's FULL output (stdout and stderr) is
#   written to DIR/<step>.log (DIR: --out, else $OUT when the device tool sets it, else gpu-check-out/),
#   the figure lines to DIR/figures.jsonl, and a one-screen summary of every step (status, seconds, log
#   file) and every figure is printed at the end and kept in DIR/summary.txt: a failure's reason is in
#   its log, never cut to the last lines.
# Prints JSON lines {"bench": NAME, "value": X, "unit": U, "reference": R, "ratio": X/R (higher = better),
# "goal": G}, or {"bench": NAME, "skipped"|"error": "one line"}. Steps, by set:
#   install  (every set) .whl/*.whl into /tmp/site, first on PYTHONPATH after this repository;
#   detect   (every set) the real hardware detection (agent/hardware.py) and the capability it signs;
#   tests    (core, all) the tests of this issue that mean something on a GPU, on the GPU machine;
#   gpu_check (core: peft_bf16 packed [+ ddp]; qlora: qlora; unsloth: unsloth unsloth_packed; kinds: dpo, full;
#            all: every case but unsloth's)
#            scripts/gpu_check.py: a random-weight Qwen2.5-0.5B-shape model; two workers' training, a replay
#            of one segment, run-to-run and replay drift, tokens/s (peft/qlora against a bare loop, goal 0.95;
#            unsloth against the worker's peft backend, goal 1.5; a DPO job against SFT at the same shape,
#            goal 0.7; full fine-tuning of a 71M-parameter model against LoRA on it, goal 0.5, with MFU);
#            with two or more GPUs the ddp case (NCCL);
#   multi_gpu (core, all; only with two or more GPUs) the worker's data-parallel path through real agents;
#   network  (core, all) `infernet demo`: a submitter and two worker processes sharing the GPU, one job;
#   bench_train (core, unsloth, all) scripts/bench_train.py --device cuda --shape qwen2.5-0.5b: the worker vs
#            its bare backend (goal 0.95), replay cost, and with unsloth the unsloth_vs_peft_tokens_per_s row.
set -uo pipefail
cd "$(dirname "$0")/.."
SET=all
OUTDIR="${OUT:-gpu-check-out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUTDIR="$2"; shift 2;;
    --out=*) OUTDIR="${1#--out=}"; shift;;
    all|core|qlora|unsloth|kinds|bench) SET="$1"; shift;;
    *) echo "gpu_check: unknown argument '$1' (a set: all, core, qlora, unsloth, kinds, bench; or --out DIR)" >&2; exit 2;;
  esac
done
mkdir -p "$OUTDIR" || { echo "gpu_check: cannot create $OUTDIR" >&2; exit 2; }
OUTDIR="$(cd "$OUTDIR" && pwd)"
: > "$OUTDIR/figures.jsonl"; : > "$OUTDIR/steps.tsv"
PY="${PYTHON:-python3}"
T_TESTS="${T_TESTS:-120}" T_GPU_CHECK="${T_GPU_CHECK:-330}" T_MULTI="${T_MULTI:-150}" T_BENCH="${T_BENCH:-150}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
started=$SECONDS
step() { echo "{\"step\": \"$1\", \"set\": \"$SET\", \"elapsed_s\": $((SECONDS - started))}"; }
# run NAME CMD...: the command's full output to $OUTDIR/NAME.log (and to our stdout); its figure lines
# (JSON objects with "bench") to figures.jsonl; its status and seconds to steps.tsv
run() {
  local name="$1"; shift
  step "$name"
  local t0=$SECONDS
  "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  cat "$OUTDIR/$name.log"
  grep -E '^\{"bench"' "$OUTDIR/$name.log" >> "$OUTDIR/figures.jsonl" || true
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUTDIR/steps.tsv"
  [ $rc -eq 0 ] || status=1
  return $rc
}
summary() {
  "$PY" - "$OUTDIR" <<'PYEOF' | tee "$OUTDIR/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"gpu_check summary ({out})")
print(f"{'step':<12} {'status':<8} {'s':>5}  log")
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    print(f"{name:<12} {'ok' if rc == '0' else 'FAIL ' + rc:<8} {seconds:>5}  {out / (name + '.log')}")
print(f"{'figure':<44} {'value':>12} {'ratio':>7} {'goal':>6}")
for line in (out / "figures.jsonl").read_text().splitlines():
    try:
        f = json.loads(line)
    except ValueError:
        continue
    if "value" in f:
        ratio = f.get("ratio")
        print(f"{f['bench'][:44]:<44} {str(f['value'])[:12]:>12} {'' if ratio is None else format(ratio, '.3g'):>7} "
              f"{'' if f.get('goal') is None else f['goal']:>6}")
    elif "skipped" in f or "error" in f:
        print(f"{f['bench'][:44]:<44} {('skipped: ' + str(f['skipped'])) if 'skipped' in f else ('ERROR: ' + str(f['error']))}"[:150])
    else:
        print(f"{f['bench'][:44]:<44} {json.dumps({k: v for k, v in f.items() if k != 'bench'})}"[:150])
PYEOF
}

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

detect() {
"$PY" - <<'PYEOF'
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
}
run detect detect
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)

if [ "$SET" = all ] || [ "$SET" = core ]; then
  # shellcheck disable=SC2086  # TESTS: a list of paths
  run tests timeout -k 10 "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -rfEs ${TESTS:-tests/test_hardware.py \
      tests/protocol/test_fit.py tests/train/test_presets.py \
      tests/train/test_train.py::test_backend_selection tests/roles/test_gpu_jobs.py tests/roles/test_supervised.py}
fi

case "$SET" in
  all) cases="peft_bf16 packed dpo full qlora ddp" ;;   # unsloth: its own set, a second call (its warm-up alone is ~45 s)
  kinds) cases="dpo full" ;;   # issue 26: DPO and full fine-tuning on the GPU
  core) cases="peft_bf16 packed ddp" ;;
  unsloth) cases="unsloth unsloth_packed" ;;
  bench) cases="" ;;
  *) cases="$SET" ;;
esac
cases="${CASES:-$cases}"
[ "$SET" = bench ] || run gpu_check timeout -k 10 "$T_GPU_CHECK" "$PY" scripts/gpu_check.py --steps 40 ${cases:+--only $cases}

if { [ "$SET" = all ] || [ "$SET" = core ]; } && [ "$GPUS" -ge 2 ]; then
  # the worker's data-parallel path through real agents; its ranks use NCCL on two or more GPUs
  run multi_gpu timeout -k 10 "$T_MULTI" "$PY" -m pytest -q -p no:cacheprovider -m slow \
      tests/train/test_data_parallel.py tests/roles/test_data_parallel_worker.py
fi

if { [ "$SET" = all ] || [ "$SET" = core ]; } && [ -z "${SKIP_NETWORK:-}" ]; then
  # a real network on the GPU: `infernet demo`, a submitter and two workers as separate `agent run`
  # processes sharing the GPU, one job end to end; its wall time, losses and verdicts are in network.log
  run network timeout -k 10 "${T_NETWORK:-120}" "$PY" -m agent.cli demo --workers 2 --shards 2 --rounds 2 --steps 12 \
      --dir "$OUTDIR/demo-net"
fi

if [ "$SET" = bench ]; then
  runtime=peft
  unsloth_ok=$("$PY" -c 'from agent.hardware import unsloth_installed; print(int(unsloth_installed()))' 2>/dev/null || echo 0)
  [ "$unsloth_ok" = 1 ] && runtime=unsloth
  run bench_train timeout -k 10 "$T_BENCH" "$PY" scripts/bench_train.py --device cuda --shape qwen2.5-0.5b \
      --runtime "$runtime" --steps 40 --checkpoint-every 20 --repeats 2
fi

step done
summary
exit $status
