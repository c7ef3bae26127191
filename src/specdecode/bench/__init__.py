"""The benchmark harness (``specdecode bench``) and the offline simulator (``specdecode simulate``).

    datasets.py   the ``--data`` workloads: question files (read and checked by
                  specdecode/questions.py), the Spec-Bench dev half, code-edit
    contenders.py what is timed: our methods through the engine, and the peers
                  (transformers generate / prompt lookup, llama.cpp plain / prompt lookup)
    peer_process.py  each llama.cpp peer in a process of its own: a crash fails the peer only
    llama_tools.py   llama.cpp's llama-bench and llama-perplexity as peers
    runner.py     the timed loop: warm-up, contenders interleaved prompt by prompt, repeats
    metrics.py    records -> summary.json (per method, per task and overall)
    report.py     summary -> report.md and PNG plots
    runner_set.py the runners ``--runners`` / ``--perplexity`` build, without a float32 copy
                  of a large GGUF file
    runners.py    ``--runners``: forward cost per row count, memory bound, ar end to end
    roofline.py   ``--runners``: the int4 runner's roofline (the extension's micro-kernels)
    projection.py each method's speedup projected onto another file's row costs
    perplexity.py ``--perplexity``: llama-perplexity's rule on the native runner
    simulate.py   replays recorded ``ar`` outputs through model-free proposers
    serving.py    scripts/serving_bench.py: our server beside llama-server through the
                  openai client at several concurrencies (serving_workloads.py,
                  serving_client.py, serving_servers.py, serving_report.py;
                  code_edit.py holds the code-edit requests)
    cli.py        the ``specdecode bench`` command
"""
