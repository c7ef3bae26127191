"""ParallelBench's lesson measured: each policy's failure rate on tasks whose output tokens
depend on each other, as its parallelism (positions committed a step) grows, with a model
whose conditionals are exact (``specdecode.diffusion.parallelbench``). No network: seconds.

    PYTHONPATH=src python scripts/parallelbench.py [--length 6] [--instances 50]
"""

from __future__ import annotations

import argparse

from specdecode.diffusion.parallelbench import TASKS, failure_rate
from specdecode.diffusion.registry import get_policy

#: (label, policy, config): the reference, the exact one, a threshold sweep, the others' defaults
POINTS = [("one_per_step", "one_per_step", {}), ("freedave", "freedave", {})] + \
    [(f"threshold {t}", "threshold", {"threshold": t}) for t in (0.9, 0.7, 0.5, 0.3, 0.1)] + \
    [(name, name, {}) for name in ("prophet", "localleap", "ete", "ccd")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=6, help="items per list (2..7)")
    parser.add_argument("--instances", type=int, default=50, help="instances per task")
    args = parser.parse_args()
    print("| policy | " + " | ".join(f"{t}: tokens/step, failed" for t in TASKS) + " |")
    print("|---|" + "---|" * len(TASKS))
    for label, name, config in POINTS:
        cells = []
        for task in TASKS:
            failed, per_step = failure_rate(get_policy(name).make(config), task, args.length,
                                            args.instances)
            cells.append(f"{per_step:.2f}, {failed:.0%}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
