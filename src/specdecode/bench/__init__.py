"""The benchmark harness (``specdecode bench``) and the offline simulator (``specdecode simulate``).

    datasets.py   Spec-Bench question files: reading, checking, tasks, per-task samples
    contenders.py what is timed: our methods through the engine, and the peers
                  (transformers generate / prompt lookup, llama.cpp plain / prompt lookup)
    runner.py     the timed loop: warm-up, contenders interleaved prompt by prompt, repeats
    metrics.py    records -> summary.json (per method, per task and overall)
    report.py     summary -> report.md and PNG plots
    simulate.py   replays recorded ``ar`` outputs through model-free proposers
    cli.py        the ``specdecode bench`` command
"""
