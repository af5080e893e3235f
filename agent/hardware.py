"""What this machine has, measured with torch at start: the facts the signed capability carries.

Rules of this file:
- ``detect()`` measures, it does not assume: CUDA devices through ``torch.cuda`` (count, name, total
  and free memory from ``mem_get_info``, compute capability, bf16 = compute capability >= 8.0), an
  Apple MPS device when torch has one, the CPU model from /proc/cpuinfo (platform fallback), its
  logical cores and the RAM. A torch without CUDA, or a CUDA call that fails, gives no devices.
- ``summary()`` turns a ``Machine`` into the capability's old ``hardware`` field: the best device
  (the CUDA device with the most memory) or the CPU, whose ``vram_gb`` is then 0.
- ``runtimes()``: peft everywhere; unsloth only with a CUDA device and unsloth installed in this
  interpreter (or ``INFERNET_UNSLOTH_PYTHON`` naming another environment's Python).
- Tests declare a ``Machine`` (a GPU this CPU machine does not have) instead of patching torch.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass, replace

from protocol import messages as m

GIB = float(1 << 30)


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    cpu_threads: int
    ram_gb: float
    devices: tuple[m.Device, ...] = ()

    @property
    def cuda(self) -> tuple[m.Device, ...]:
        return tuple(d for d in self.devices if d.kind == "cuda")

    def best_free_vram_gb(self) -> float:
        return max((d.vram_free_gb for d in self.cuda), default=0.0)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()[:200]
    except OSError:
        pass
    return (platform.processor() or platform.machine() or "cpu")[:200]


def ram_gb() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)
    except (ValueError, OSError, AttributeError):
        return 0.0


def cuda_devices() -> tuple[m.Device, ...]:
    """Every visible CUDA device with its memory now; () without CUDA."""
    import torch

    try:
        if not torch.cuda.is_available():
            return ()
        out = []
        for index in range(min(torch.cuda.device_count(), m.MAX_DEVICES)):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            out.append(m.Device("cuda", index, props.name[:200], round(total / GIB, 2),
                                round(min(free, total) / GIB, 2), f"{props.major}.{props.minor}", props.major >= 8))
        return tuple(out)
    except (RuntimeError, AssertionError):  # a driver that fails to initialise: no usable GPU
        return ()


def mps_devices() -> tuple[m.Device, ...]:
    import torch

    backend = getattr(torch.backends, "mps", None)
    if backend is None or not backend.is_available():
        return ()
    memory = ram_gb()  # unified memory
    return (m.Device("mps", 0, "Apple MPS", memory, memory, "", True),)


def detect() -> Machine:
    """Measure this machine (imports torch; call it off the event loop)."""
    return Machine(cpu_model(), os.cpu_count() or 1, ram_gb(), cuda_devices() + mps_devices())


def refresh_free(machine: Machine) -> Machine:
    """The same machine with the CUDA devices' free memory measured again."""
    if not machine.cuda:
        return machine
    now = {d.index: d for d in cuda_devices()}
    return replace(machine, devices=tuple(
        replace(d, vram_free_gb=min(now[d.index].vram_free_gb, d.vram_total_gb)) if d.kind == "cuda" and d.index in now
        else d for d in machine.devices))


def within_limits(device: m.Device) -> m.Device:
    """``device`` with its free memory inside [0, total], as the capability's rules require: a declared
    total below the measured free memory (an operator's or the harness's declaration) made our own
    capability fail our own check, and the heartbeat that sent it ended the agent (issue 22)."""
    free = min(max(device.vram_free_gb, 0.0), device.vram_total_gb)
    return device if free == device.vram_free_gb else replace(device, vram_free_gb=free)


def summary(machine: Machine) -> m.Hardware:
    """The capability's ``hardware``: the CUDA device with the most memory, else the CPU."""
    if machine.cuda:
        best = max(machine.cuda, key=lambda d: d.vram_total_gb)
        return m.Hardware("cuda", best.name, best.vram_total_gb, machine.ram_gb, machine.cpu_threads)
    return m.Hardware("cpu", machine.cpu_model, 0.0, machine.ram_gb, machine.cpu_threads)


def unsloth_installed() -> bool:
    return bool(os.environ.get("INFERNET_UNSLOTH_PYTHON")) or importlib.util.find_spec("unsloth") is not None


def runtimes(machine: Machine) -> tuple[str, ...]:
    return ("peft", "unsloth") if machine.cuda and unsloth_installed() else ("peft",)
