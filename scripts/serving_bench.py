"""Serving many users at once: `specdecode serve` (ar, the default method) beside llama.cpp's
`llama-server`, through the openai client (see specdecode/bench/serving.py, docs/server.md).

    python scripts/serving_bench.py --out docs/results/serving-xeon-amx          # the full sweep
    python scripts/serving_bench.py --servers ar --workloads code-edit --samplings greedy \
        --concurrency 1,4 --requests 4 --max-tokens 16 --out /tmp/serving-small  # a quick check
"""

import sys

from specdecode.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
