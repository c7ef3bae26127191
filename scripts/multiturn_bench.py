"""Multi-turn serving: time to first token of every turn sent with its whole history, our
server with and without its prompt cache beside llama-server with and without its own (see
specdecode/bench/multiturn.py, docs/server.md).

    python scripts/multiturn_bench.py --llama-cpp DIR --out docs/results/multiturn-zen5
    python scripts/multiturn_bench.py --model smollm2 --servers specdecode,specdecode-no-cache \
        --workloads chat --max-tokens 16 --out /tmp/multiturn-small          # a quick check
"""

import sys

from specdecode.bench.multiturn import main

if __name__ == "__main__":
    sys.exit(main())
