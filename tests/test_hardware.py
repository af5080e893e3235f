"""Hardware is measured, not assumed: the real detection on this machine, and the summary of a declared GPU."""

from __future__ import annotations

import os

import torch

from agent import hardware
from protocol import messages as m


def test_detection_on_this_machine_matches_what_torch_and_the_os_say():
    machine = hardware.detect()
    assert machine.cpu_model and machine.cpu_threads == (os.cpu_count() or 1) and machine.ram_gb > 0
    assert len(machine.cuda) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for device in machine.cuda:  # on a GPU machine: every device measured, free within total
        assert 0 < device.vram_free_gb <= device.vram_total_gb and device.compute_capability
    summary = hardware.summary(machine)
    if not machine.cuda:
        assert summary == m.Hardware("cpu", machine.cpu_model, 0.0, machine.ram_gb, machine.cpu_threads)
        assert hardware.runtimes(machine) == ("peft",)  # unsloth needs CUDA, whatever is installed
    # what the agent signs decodes under the strict rules
    m.Device.from_wire(m.Device("cuda", 0, "x", 1.0, 1.0, "8.0", True).to_wire())


def test_the_summary_of_a_declared_multi_gpu_machine_names_the_largest_device():
    declared = hardware.Machine("EPYC", 64, 512.0, (
        m.Device("cuda", 0, "Tesla T4", 15.0, 14.0, "7.5", False),
        m.Device("cuda", 1, "NVIDIA A100-SXM4-80GB", 80.0, 20.0, "8.0", True),
    ))
    assert hardware.summary(declared) == m.Hardware("cuda", "NVIDIA A100-SXM4-80GB", 80.0, 512.0, 64)
    assert declared.best_free_vram_gb() == 20.0
    assert hardware.refresh_free(hardware.Machine("c", 1, 1.0)) == hardware.Machine("c", 1, 1.0)
