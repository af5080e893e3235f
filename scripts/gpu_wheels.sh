#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks, into .whl/ (git-ignored), for scripts/gpu_check.sh.
#
# The GPU machine (/work/.library/device/KINDS.md) has Python 3.12 with torch 2.11 (cu130), transformers,
# peft, accelerate, safetensors, msgpack, pyyaml, rich, pytest, pytest-timeout, hypothesis ... and no
# registry. This script fetches, as Python-3.12 manylinux x86_64 wheels (pip download --no-deps
# --only-binary=:all:, /work/.library/device/README.md "wheels"), exactly the rest of our dependency
# closure. The lists below were derived from the Requires-Dist closure of pyproject.toml's dependencies
# (+ pytest-trio; + bitsandbytes; + unsloth), minus the image's package list, at the versions our .venv
# holds; protobuf is carried anyway (libp2p's generated code needs protobuf >= 6, the image's is unknown).
#
# Usage (from anywhere; PYTHON: a Python with pip, default .venv/bin/python else python3):
#   scripts/gpu_wheels.sh [core|qlora|unsloth]      (default: unsloth, the largest; each set holds the ones before)
#     core     agent + tests: trio, libp2p and its deps, pynacl, pytest-trio, ...     (~21 MB)
#     qlora    core + bitsandbytes (its CUDA 13 and CPU libraries only: the wheel's  (~26 MB)
#              other CUDA/ROCm/XPU builds are stripped here, 43 -> ~5 MB)
#     unsloth  qlora + unsloth and what it needs (its web "studio" stripped, 29 -> ~4 MB) (~50 MB)
#   The carry limit is 64 MiB for the working tree and the wheels together; the script fails above 60 MiB.
# Then, in one device `run` (see scripts/gpu_check.sh's header for the exact call): carry [".whl"].
#
# Wheels no registry offers for cp312, handled here:
#   - fastecdsa: libp2p pins 2.3.2, an sdist (C + GMP) with no cp312 wheel; 4.0.0 (a cp312 wheel) is carried.
#     libp2p imports it at load (crypto/ecc.py, key_exchange.py); only P-256 keys and secio use it, which our
#     hosts don't (Ed25519 identities, Noise), and its 4.x encoder API differs there.
#   - xformers is not carried: the only cp312 wheel pip offers for it was built for another torch than the GPU
#     image's and does not load (seen on the H100, issue 22); unsloth runs without it (torch SDPA attention).
#   - varint, python-baseconv: pure-Python sdists; built here into py3-none-any wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
SET="${1:-unsloth}"
case "$SET" in core|qlora|unsloth) ;; *) echo "gpu_wheels: unknown set '$SET' (core, qlora or unsloth)" >&2; exit 2;; esac
PY="${PYTHON:-}"
if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi

CORE=(
  trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 pytest-trio==0.8.0
  libp2p==0.8.1 multiaddr==0.2.0 pynacl==1.6.2 cffi==2.1.1 pycparser==3.12 ipfshttpclient==0.7.0
  aioquic==1.7.2 pylsqpack==1.0.0 cryptography==50.0.2 pyopenssl==26.4.0 service-identity==26.1.0
  base58==2.1.1 cbor2==6.3.0 coincurve==21.0.0 fastecdsa==4.0.0 lru-dict==1.4.1 miniupnpc==2.3.3
  types-requests==2.33.0.20261030 mypy-protobuf==5.1.0 types-protobuf==7.35.1.20260906 noiseprotocol==0.3.1
  protobuf==6.33.6 pycryptodome==4.4.0 py-multibase==2.0.0 py-multihash==3.0.0 py-multicodec==1.0.0
  py-cid==0.5.0 rpcudp==5.0.1 u-msgpack-python==2.8.0 async-generator==1.10 trio-typing==0.10.0
  trio-websocket==0.12.2 wsproto==1.3.2 zeroconf==0.150.5 ifaddr==0.2.0 dnspython==2.9.2 netaddr==1.3.0
  morphys==1.0 blake3==1.0.11 mmh3==5.3.1 importlib-metadata==10.2.0 lazy-importer==0.1.0
)
CORE_SDISTS=(varint==1.0.2 python-baseconv==1.2.2)
QLORA=(bitsandbytes==0.50.2)
UNSLOTH=(
  unsloth==2026.10.9 unsloth-zoo==2026.10.9 torchao==0.18.0 cut-cross-entropy==25.1.1
  trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 diffusers==0.42.1 hf-transfer==0.1.9
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 json5==0.17.3 nest-asyncio==1.6.0 structlog==26.1.0
  msgspec==0.22.0
)

wanted=("${CORE[@]}")
[ "$SET" = core ] || wanted+=("${QLORA[@]}")
[ "$SET" = unsloth ] && wanted+=("${UNSLOTH[@]}")
platforms=()
for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf .whl
mkdir -p .whl
echo "gpu_wheels: set $SET: ${#wanted[@]} wheels + ${#CORE_SDISTS[@]} built from pure-Python sdists" >&2
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wanted[@]}"
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w .whl "${CORE_SDISTS[@]}"

# Strip what the GPU machine never loads, rewriting each wheel's RECORD to match.
"$PY" - <<'PYEOF'
import fnmatch, glob, os, zipfile

STRIP = {  # wheel name prefix -> member patterns to leave out
    "bitsandbytes-": ["bitsandbytes/libbitsandbytes_cuda1[12]*.so", "bitsandbytes/libbitsandbytes_rocm*.so",
                      "bitsandbytes/libbitsandbytes_xpu*.so"],
    "unsloth-": ["studio/*"],
}
for path in sorted(glob.glob(".whl/*.whl")):
    patterns = next((p for prefix, p in STRIP.items() if os.path.basename(path).startswith(prefix)), None)
    if not patterns:
        continue
    before = os.path.getsize(path)
    drop = lambda name: any(fnmatch.fnmatch(name, p) for p in patterns)
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if drop(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not drop(line.split(",", 1)[0])).encode()
            out.writestr(info, data)
    os.replace(path + ".tmp", path)
    print(f"gpu_wheels: {os.path.basename(path)}: {before / 2**20:.1f} -> {os.path.getsize(path) / 2**20:.1f} MiB",
          file=__import__("sys").stderr)
PYEOF

count=$(ls .whl/*.whl | wc -l)
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $count wheels, $((bytes / 1048576)) MiB in .whl/" >&2
if [ "$bytes" -gt $((60 * 1048576)) ]; then
  echo "gpu_wheels: over 60 MiB: with the working tree it would pass the 64 MiB carry limit; use a smaller set" >&2
  exit 1
fi
