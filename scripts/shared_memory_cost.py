"""What the replicas' shared suffix memory costs per request (server/shared_memory.py).

Two replica-side memories (:class:`SyncedMemory`, as each Serve replica holds one) and the
memory actor on a local Ray cluster, with no model: replica A pushes responses of ``--tokens``
token ids (as each finished request does), replica B pulls them (as it does before a request
when its last pull is older than ``--sync-interval``). Measured:

- push: the time a replica's scheduler thread spends handing a response to Ray (the call is
  not awaited), and the actor's time per push (insert into its tree and log);
- pull: the time a request waits before it starts, with 0, 1 and 8 new responses (the actor
  round trip plus the inserts into the replica's local tree).

    python scripts/shared_memory_cost.py --responses 200 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from specdecode import registry
from specdecode.server.shared_memory import SyncedMemory, memory_actor


async def measure(args) -> dict:
    import ray

    config = registry.get("suffix").make_config()
    actor = memory_actor(None, config, "specdecode-cost")
    a = SyncedMemory(actor, config, 0.0)
    b = SyncedMemory(actor, config, 0.0)
    await a.pull()
    await b.pull()
    rng = random.Random(0)
    # text-like responses: a small vocabulary of frequent tokens, so suffixes repeat
    words = [rng.randrange(49152) for _ in range(300)]
    responses = [[rng.choice(words) for _ in range(args.tokens)] for _ in range(args.responses)]

    start = time.perf_counter()
    for ids in responses:
        a._push(ids)
    submitted = time.perf_counter() - start
    await actor.stats.remote()  # after every push (one caller's calls run in order)
    actor_s = time.perf_counter() - start

    pulls = {}
    for new in (0, 1, 8):
        times = []
        for _ in range(args.repeats):
            for ids in responses[:new]:
                a._push(ids)
            await actor.stats.remote()
            t = time.perf_counter()
            await b.pull(force=True)
            times.append(time.perf_counter() - t)
        pulls[new] = sorted(times)[len(times) // 2]
    ray.kill(actor)
    return {"responses": args.responses, "tokens": args.tokens,
            "push_submit_ms": round(1e3 * submitted / args.responses, 3),
            "push_actor_ms": round(1e3 * actor_s / args.responses, 3),
            **{f"pull_{n}_new_ms": round(1e3 * s, 3) for n, s in pulls.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64, help="token ids per response")
    parser.add_argument("--repeats", type=int, default=20, help="pulls per measurement (median)")
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="specdecode-cost")
    try:
        print(json.dumps(asyncio.run(measure(args))))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
