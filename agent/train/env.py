"""The facts about this process that change float results, recorded in every proof header.

Rules of this file:
- ``environment()`` returns exactly the keys of protocol.proof.DETERMINISM_FIELDS and
  GPU_DETERMINISM_FIELDS (``data_parallel`` only for a data-parallel run). Two runs with
  equal values on CPU in float32 reproduce each other bit for bit (measured: a segment resumed in
  another process matches exactly); with different thread counts or CPU instruction sets results
  drift by ~1e-6..1e-5 relative after 50 steps.
- ``STRICT_CPU_ENV`` pins oneMKL and ATen to the AVX2 code paths (``MKL_CBWR=AVX2,STRICT``,
  ``ATEN_CPU_CAPABILITY=avx2``), which made AVX2 and AVX-512 machines agree bit for bit at a
  0-35 % speed cost. These variables act only when set before torch is imported, so a process
  is started with them (``strict_cpu_env()`` for a child's environment); they cannot be switched
  on later, only recorded.
- The thread count is set explicitly (``set_threads``) and recorded, never left to torch's guess.
"""

from __future__ import annotations

import os

import torch

STRICT_CPU_ENV = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def strict_cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default: os.environ) with the strict CPU determinism variables set."""
    env = dict(os.environ if base is None else base)
    env.update(STRICT_CPU_ENV)
    return env


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def _version(module: str) -> str:
    """A library's version if this process imported it (a run that did not use it records "")."""
    import sys

    loaded = sys.modules.get(module)
    return str(getattr(loaded, "__version__", "")) if loaded is not None else ""


def device_class(device: str) -> str:
    """``cpu``, or ``cuda-sm<major><minor>`` of the current CUDA device (kernels differ per architecture)."""
    if device == "cpu":
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"cuda-sm{major}{minor}"


def environment(device: str, dtype: torch.dtype, backend: str, *, micro_batch: int = 0,
                quantization: str = "none", processes: int = 1) -> dict[str, str | int]:
    """The header's environment; ``data_parallel`` (the number of processes that trained, IPIP-0005 §6.1)
    only when more than one did, so a single process's header is what it always was."""
    import peft
    import transformers

    parallel = {"data_parallel": int(processes)} if processes > 1 else {}
    return {
        "torch": torch.__version__,
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "device": "cpu" if device == "cpu" else f"cuda:{torch.cuda.get_device_name()}",
        "device_class": device_class(device),
        "cuda": "" if device == "cpu" else str(torch.version.cuda or ""),
        "dtype": DTYPE_NAMES[dtype],
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", ""),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "backend": backend,
        "micro_batch": int(micro_batch),
        "quantization": quantization,
        "bitsandbytes": _version("bitsandbytes") if quantization != "none" else "",
        "unsloth": _version("unsloth") if backend == "unsloth" else "",
        **parallel,
    }
