#!/usr/bin/env bash
# Install the project into a virtual environment: torch first, pinned (an unpinned torch pulls several GB of CUDA
# wheels), then the project with its extras. With uv when it can be had (about 20 s on the 2-core machine,
# against 2.5 min for pip: a quarter of CI's 15 minutes went to pip), reading pip's own settings (pip.conf, the
# PIP_* variables: its find-links and indexes); with pip when uv cannot be installed or fails, or with
# INFERNET_NO_UV=1. The two resolve the same versions here.
# usage: scripts/install_venv.sh VENV TORCH_REQUIREMENT EDITABLE_TARGET
set -euo pipefail
venv=$1 torch=$2 target=$3
py=$venv/bin/python
pip_install=("$py" -m pip install -q --disable-pip-version-check)
if [ "${INFERNET_NO_UV:-}" != 1 ] && "${pip_install[@]}" uv >/dev/null 2>&1; then
    # --compile-bytecode: pip writes the .pyc files when it installs, uv does not; with PYTHONDONTWRITEBYTECODE set
    # (CI's machine sets it) every agent process then compiled torch and transformers anew: the suite took 17 min
    args=(--python "$py" --index-strategy unsafe-best-match --compile-bytecode)
    for link in $("$py" -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
        args+=(--find-links "$link")
    done
    for index in $("$py" -m pip config get global.extra-index-url 2>/dev/null || true) ${PIP_EXTRA_INDEX_URL:-}; do
        args+=(--extra-index-url "$index")
    done
    index=${PIP_INDEX_URL:-$("$py" -m pip config get global.index-url 2>/dev/null || true)}
    if [ -n "$index" ]; then
        args+=(--index-url "$index")
    fi
    if "$venv/bin/uv" pip install -q "${args[@]}" "$torch" && "$venv/bin/uv" pip install -q "${args[@]}" -e "$target"; then
        exit 0
    fi
    echo "note: uv could not install the project; pip installs it instead" >&2
fi
"${pip_install[@]}" "$torch"
"${pip_install[@]}" -e "$target"
