"""One speculation memory for every engine replica (``specdecode serve --replicas N``).

In one process every slot shares one SuffixDecoding global tree (:mod:`.memory`). With several
replicas, each in its own process and possibly on its own machine, a tree cannot be shared by
reference, and drafting must not wait for the network: it runs at every verify step. So:

- one Ray actor, :class:`MemoryLog`, owns the shared state: the finished responses in arrival
  order, each with a version number, and the global tree built from them (for saving). It is
  bounded like a replica's tree, by ``max_cached_requests`` responses, oldest dropped first;
- each replica keeps its own local :class:`~specdecode.suffix_cache.SuffixCache` (drafting reads
  only this one, under its lock, as in one process) through :class:`SyncedMemory`:
  **push**: when a response joins the local global tree (the proposer's ``finish``), its token
  ids go to the actor, fire and forget (one ``.remote()`` call, nothing awaited);
  **pull**: before a request starts, when the last pull is older than ``sync_interval``
  seconds, the replica fetches the responses of *other* replicas newer than the version it has
  seen and adds them to its tree. So a replica drafts from every other replica's responses at
  most ``sync_interval`` s (plus one request) late; with 0 it pulls before every request.
- with ``--suffix-cache PATH`` the actor loads PATH at start and saves it on shutdown, in the
  format of the single-process server (the two read each other's files).

The actor is separate from the replicas: a replica that dies loses at most the pushes it had not
sent; a restarted replica pulls everything (its version starts at 0) and drafts well from its
first request. Each actor incarnation has an ``epoch``: a replica that sees another epoch
(the actor was restarted from the file) pulls from version 0 again.

What is not shared, and why: token recycling's matrix and lookahead's n-gram pool are
per-slot state in the single-process server too (each slot's proposer keeps its own), and they
are rewritten by every verify step of that slot: recycling's row ``t`` is "the target's top-k
after the latest ``t`` this slot saw", overwritten for every draft node of every forward, so it
re-warms within one request; shipping it would mean one push per verify step (dozens of rows of
8 ids each) for state that is stale by the next step. The suffix tree is the memory that learns
*across* requests from finished responses, so it is the one shared.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from pathlib import Path

from specdecode.server.memory import SharedMemory
from specdecode.suffix_cache import SuffixCache

log = logging.getLogger("specdecode.server")

#: the actor's name in its Ray namespace: replicas and the ingress find it by this name
MEMORY_ACTOR = "specdecode-memory"


class MemoryLog:
    """The shared memory (run as a Ray actor): versioned responses and the tree built from
    them. ``push`` adds one response; ``since`` returns what a replica has not seen yet."""

    def __init__(self, path: str | None, suffix_config):
        self.path = path
        self.max_cached_requests = suffix_config.max_cached_requests
        loaded = SharedMemory(path, suffix_config).global_cache  # checks depth, loads the file
        self.cache = SuffixCache(loaded.max_tree_depth, self.max_cached_requests)
        self.log: collections.deque = collections.deque(maxlen=max(1, self.max_cached_requests))
        self.version = 0
        self.epoch = uuid.uuid4().hex
        for rid in loaded.cached_requests:
            self.push("file", loaded.cached_response(rid))

    def push(self, origin: str, ids: list[int]) -> int:
        """Add one finished response from replica ``origin``; returns its version."""
        if self.max_cached_requests == 0 or not ids:
            return self.version
        self.version += 1
        self.cache.add_cached(self.version, ids)
        self.log.append((self.version, origin, ids))
        return self.version

    def since(self, version: int, origin: str) -> tuple[str, int, list[tuple[int, list[int]]]]:
        """``(epoch, current version, [(version, ids), ...])``: the responses newer than
        ``version`` that ``origin`` did not push itself (it has them already), oldest first;
        at most ``max_cached_requests`` of them, which is all a replica's tree can hold."""
        return self.epoch, self.version, [(v, ids) for v, o, ids in self.log
                                           if v > version and o != origin]

    def save(self) -> int:
        """Write the shared tree to ``path`` (when given); returns the responses saved."""
        if self.path is not None:
            path = Path(self.path).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self.cache.save(path)
            log.info("saved %d shared responses to %s", len(self.cache.cached_requests), path)
        return len(self.cache.cached_requests)

    def stats(self) -> dict:
        return {"version": self.version, "responses": len(self.cache.cached_requests),
                "tokens": self.cache.num_cached_tokens}


def memory_actor(path: Path | None, suffix_config, namespace: str):
    """The cluster's memory actor: created on first use, found by name afterwards. Detached, so
    it outlives a deploying driver (``serve run``); it restarts after a crash (reloading the
    file). Takes no CPU reservation: it works only on pushes and pulls."""
    import ray

    actor = ray.remote(MemoryLog).options(
        name=MEMORY_ACTOR, namespace=namespace, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_task_retries=-1)
    return actor.remote(None if path is None else str(path), suffix_config)


class _PublishingCache(SuffixCache):
    """A replica's local tree that hands every response it caches to ``publish``."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int, publish):
        super().__init__(max_tree_depth, max_cached_requests)
        self.publish = publish

    def stop_request(self, req_id, response=None) -> None:
        super().stop_request(req_id, response)
        with self._lock:
            ids = self._global.sequence(req_id) if req_id in self._cached else None
        if ids:
            self.publish(ids)


class SyncedMemory(SharedMemory):
    """A replica's memory: the single-process :class:`SharedMemory` (one tree for its slots),
    kept in sync with the :class:`MemoryLog` actor. Counts what syncing costs (``stats``)."""

    def __init__(self, actor, suffix_config, sync_interval: float):
        super().__init__(None, suffix_config)
        self.actor = actor
        self.sync_interval = sync_interval
        self.origin = uuid.uuid4().hex
        self.global_cache = _PublishingCache(suffix_config.max_tree_depth,
                                             suffix_config.max_cached_requests, self._push)
        self.epoch = None
        self.version = 0
        self.pulled_at = float("-inf")
        self.costs = {"pushes": 0, "push_s": 0.0, "pulls": 0, "pull_s": 0.0,
                      "pulled_responses": 0}

    def _push(self, ids: list[int]) -> None:
        started = time.perf_counter()
        self.actor.push.remote(self.origin, ids)  # not awaited: generation never waits for it
        self.costs["pushes"] += 1
        self.costs["push_s"] += time.perf_counter() - started

    async def pull(self, force: bool = False) -> None:
        """Add the other replicas' new responses, when the last pull is older than
        ``sync_interval`` (or ``force``). Two pulls at once are harmless: a response keeps its
        id (``shared-VERSION``), so adding it twice replaces it."""
        if not force and time.monotonic() - self.pulled_at < self.sync_interval:
            return
        started = time.perf_counter()
        self.pulled_at = time.monotonic()
        epoch, version, entries = await self.actor.since.remote(self.version, self.origin)
        if self.epoch is not None and epoch != self.epoch:
            # the actor restarted from its file: its versions began again
            epoch, version, entries = await self.actor.since.remote(0, self.origin)
        for v, ids in entries:
            self.global_cache.add_cached(f"shared-{v}", ids)
        self.epoch, self.version = epoch, version
        self.costs["pulls"] += 1
        self.costs["pull_s"] += time.perf_counter() - started
        self.costs["pulled_responses"] += len(entries)


class RemoteMemory:
    """The ingress's view of the memory actor: what the routes' shutdown saves, and where."""

    def __init__(self, actor, path: Path | None):
        self.actor = actor
        self.path = None if path is None else Path(path).expanduser()

    def save(self) -> None:
        import ray

        ray.get(self.actor.save.remote())

    def stats(self) -> dict:
        import ray

        return ray.get(self.actor.stats.remote())
