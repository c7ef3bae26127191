"""Bounded load test of `specdecode serve` (see specdecode/server/loadtest.py).

    python scripts/loadtest.py --requests 64 --concurrency 8 --max-tokens 64
"""

import sys

from specdecode.server.loadtest import main

if __name__ == "__main__":
    sys.exit(main())
