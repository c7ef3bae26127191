"""The bitwise row-invariance tests again, in subprocesses, under the instruction-set limits
that ATen, oneDNN, MKL and our kernels honour: other CPUs take these code paths, and row
invariance must hold on every one of them, not only on the path this CPU picks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_flags
from specdecode import kernels

TESTS = Path(__file__).parent
#: (variable, value, /proc/cpuinfo flag the limit needs)
LIMITS = [
    ("ATEN_CPU_CAPABILITY", "default", None),
    ("ATEN_CPU_CAPABILITY", "avx2", "avx2"),
    ("ATEN_CPU_CAPABILITY", "avx512", "avx512f"),
    ("ONEDNN_MAX_CPU_ISA", "AVX2", "avx2"),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", "avx512f"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX2", "avx2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX512", "avx512f"),
    ("SPECDECODE_KERNEL_ISA", "generic", None),
    ("SPECDECODE_KERNEL_ISA", "avx2", "avx2"),
    ("SPECDECODE_KERNEL_ISA", "avx512", "avx512_vnni"),
    ("SPECDECODE_KERNEL_ISA", "amx", "amx_int8"),
]
FAST = "position_alone_equals_position_in_tree_bitwise or speculative_equals_own_ar"
#: the real model under the limits that change what a decode row runs (our kernels) and what
#: a prompt runs (MKL); the baseline variant is left to the tiny model (no FMA instructions:
#: every fused multiply-add is a library call)
REAL = [("SPECDECODE_KERNEL_ISA", "avx2", "avx2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2", "avx2")]


def run_limited(variable: str, value: str, flag: str | None, select: str, marker: str) -> str:
    if flag and flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag}: the {variable}={value} path cannot run here")
    if variable == "SPECDECODE_KERNEL_ISA" and kernels.ISA_LEVELS.index(value) > kernels.load().isa_level():
        pytest.skip(f"the OS did not grant this process the {value} state: the "
                    f"{variable}={value} path cannot run here")
    env = {**os.environ, variable: value}
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
    if variable == "SPECDECODE_KERNEL_ISA":
        assert probe.startswith(f"isa {value} "), probe
    if variable == "ATEN_CPU_CAPABILITY" and value != "default":
        assert probe.split()[-1].lower() == value, probe
    assert " passed" in result.stdout and "failed" not in result.stdout
    return result.stdout


@pytest.mark.parametrize("variable,value,flag", LIMITS, ids=[f"{v}={x}" for v, x, _ in LIMITS])
def test_row_invariance_under_isa_limit(variable, value, flag):
    kernels.load()  # built once here, not in every subprocess
    run_limited(variable, value, flag, FAST, "not slow")


@pytest.mark.slow
@pytest.mark.parametrize("variable,value,flag", REAL, ids=[f"{v}={x}" for v, x, _ in REAL])
def test_real_model_row_invariance_under_isa_limit(variable, value, flag):
    run_limited(variable, value, flag, "real_model_position_alone and (fp32 or int4)", "slow")
