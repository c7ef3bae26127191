"""``python -m specdecode.kernels``: build the CPU kernels now (scripts/setup.sh runs it)."""

from specdecode.kernels import ISA_LEVELS, build_dir, isa, load

load()
print(f"specdecode CPU kernels: {build_dir()} ({ISA_LEVELS[isa()]})")
