"""The bitwise row-invariance tests again, in subprocesses, under the instruction-set limits
that ATen, oneDNN, MKL and our kernels honour: other CPUs take these code paths, and row
invariance must hold on every one of them, not only on the path this CPU picks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cpu_flags
from specdecode import kernels

TESTS = Path(__file__).parent
#: (limits, /proc/cpuinfo flag they need): the libraries' limits of one level together (ATen's
#: own kernels, oneDNN's and MKL's, each knob set to each of its levels), our kernels' one by one
LIMITS = [
    ({"ATEN_CPU_CAPABILITY": "default"}, None),
    ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
      "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "avx2"),
    ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
      "MKL_ENABLE_INSTRUCTIONS": "AVX512"}, "avx512f"),
    ({"SPECDECODE_KERNEL_ISA": "generic"}, None),
    ({"SPECDECODE_KERNEL_ISA": "avx2"}, "avx2"),
    ({"SPECDECODE_KERNEL_ISA": "avx512"}, "avx512_vnni"),
    ({"SPECDECODE_KERNEL_ISA": "amx"}, "amx_int8"),
]
FAST = "position_alone_equals_position_in_tree_bitwise or speculative_equals_own_ar"
#: the real model under the limits that change what a decode row runs (our kernels) and what
#: a prompt runs (MKL), together; the baseline variant is left to the tiny model (no FMA
#: instructions: every fused multiply-add is a library call)
REAL = [({"SPECDECODE_KERNEL_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "avx2")]


def limit_id(limits: dict) -> str:
    return ",".join(f"{variable}={value}" for variable, value in limits.items())


def taken_here(variable: str, value: str) -> bool:
    """Whether this process takes the path ``variable=value`` names without being limited."""
    if variable == "SPECDECODE_KERNEL_ISA":
        return kernels.ISA_LEVELS[kernels.isa()] == value
    if variable == "ATEN_CPU_CAPABILITY":
        return torch.backends.cpu.get_cpu_capability().lower() == value
    # oneDNN's and MKL's AVX2 level is their top one on a CPU without AVX-512
    return value == "AVX2" and "avx512f" not in cpu_flags()


def run_limited(limits: dict, flag: str | None, select: str, marker: str) -> str:
    if flag and flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag}: the {limit_id(limits)} path cannot run here")
    kernel_isa = limits.get("SPECDECODE_KERNEL_ISA")
    if kernel_isa and kernels.ISA_LEVELS.index(kernel_isa) > kernels.load().isa_level():
        pytest.skip(f"the OS did not grant this process the {kernel_isa} state: the "
                    f"{limit_id(limits)} path cannot run here")
    if all(taken_here(variable, value) for variable, value in limits.items()):
        pytest.skip(f"this CPU takes the {limit_id(limits)} path unlimited: the tests outside "
                    "this file run it")
    env = {**os.environ, **limits}
    # one interpreter per limit: it says which paths it took, then runs the tests (a separate
    # probe process cost another start of torch for each limit)
    args = ["-q", "-p", "no:cacheprovider", "-m", marker, "-k", select,
            str(TESTS / "test_llama_runner.py")]
    script = ("import sys, pytest, torch; from specdecode import kernels; "
              "print('isa', kernels.ISA_LEVELS[kernels.isa()], "
              "torch.backends.cpu.get_cpu_capability(), flush=True); "
              f"sys.exit(pytest.main({args!r}))")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    probe = result.stdout.splitlines()[0]
    if kernel_isa:
        assert probe.startswith(f"isa {kernel_isa} "), probe
    aten = limits.get("ATEN_CPU_CAPABILITY", "default")
    if aten != "default":
        assert probe.split()[-1].lower() == aten, probe
    assert " passed" in result.stdout and "failed" not in result.stdout
    return result.stdout


@pytest.mark.parametrize("limits,flag", LIMITS, ids=[limit_id(limits) for limits, _ in LIMITS])
def test_row_invariance_under_isa_limit(limits, flag):
    kernels.load()  # built once here, not in every subprocess
    run_limited(limits, flag, FAST, "not slow")


@pytest.mark.slow
@pytest.mark.parametrize("limits,flag", REAL, ids=[limit_id(limits) for limits, _ in REAL])
def test_real_model_row_invariance_under_isa_limit(limits, flag):
    run_limited(limits, flag, "real_model_position_alone and (fp32 or int4)", "slow")
