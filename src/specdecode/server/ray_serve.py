"""``specdecode serve --replicas N``: the OpenAI routes of :mod:`.app` in front of N engine
replicas on Ray Serve, with one speculation memory (:mod:`.shared_memory`).

    specdecode serve --replicas 2                      # a local Ray cluster on this machine
    specdecode serve --replicas 8 --ray-address auto   # an existing cluster (`ray start`)
    serve run specdecode.server.ray_serve:app replicas=2   # all of it as one Serve app

Pieces:

- :class:`EngineReplica`, a Serve deployment: one model, ``--parallel`` runner slots with their
  KV caches, the single-process :class:`~.scheduler.Scheduler` and a
  :class:`~.shared_memory.SyncedMemory`. ``generate(specs)`` streams the scheduler's events.
- :class:`ReplicaPool`, the routes' backend: the same ``submit(job)`` as the local scheduler,
  so request parsing, validation, errors, streaming and metrics are the single-process server's
  own code. Each job becomes one streaming call to a replica that Serve picks (the less loaded
  of two); the events come back to the job.
- Faults: when the replica serving a job dies, the job is sent again to another (Serve
  replaces the dead one). Generation is deterministic for greedy and seeded requests, so the
  retry yields the same text; what the client already got is not sent twice. A retry that
  diverges from what was sent (an unseeded sampled request) or a third failure ends that
  choice with a 503 ``replica_failed`` error.

The ingress (HTTP, tokenizer, validation) runs in the ``specdecode serve`` process, or with
``serve run`` as a Serve deployment (:class:`ServeIngress`) behind Serve's HTTP proxy; it loads
no model: the tokenizer and the model's limits come from a replica
(:meth:`EngineReplica.describe`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.server.endpoints import DISCONNECT_POLL_S
from specdecode.server.frontend import Frontend, ModelInfo, Settings
from specdecode.server.goodput import Batching
from specdecode.server.memory import SharedMemory
from specdecode.server.metrics import Metrics
from specdecode.server.prompt_cache import PromptCache
from specdecode.server.protocol import ApiError
from specdecode.server.scheduler import Job, Scheduler, SequenceSpec
from specdecode.server.shared_memory import SyncedMemory

log = logging.getLogger("specdecode.server")

#: the Serve application and the Ray namespace of its memory actor
APP_NAME = "specdecode"
NAMESPACE = "specdecode"
#: tries per job: the first, and up to two retries on other replicas
ATTEMPTS = 3


@dataclass(frozen=True)
class NamedModel:
    """Load a model by name or path in each replica (what ``--model`` names)."""

    model: str = "smollm2"
    runner: str = "auto"
    weights: str = "auto"

    def load(self, slots: int):
        from specdecode.api import eos_ids
        from specdecode.models.loading import load_model, make_runner

        loaded = load_model(self.model)
        first = make_runner(loaded, self.runner, self.weights)
        return ([first] + [first.replica() for _ in range(slots - 1)], loaded.tokenizer,
                eos_ids(loaded, loaded.tokenizer))


@dataclass(frozen=True)
class GivenModel:
    """A transformers model object, shipped to each replica (tests, notebooks): each slot an
    ``hf`` runner over the replica's copy."""

    model: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]

    def load(self, slots: int):
        from specdecode.models.hf import HFRunner

        return ([HFRunner(self.model) for _ in range(slots)], self.tokenizer,
                list(self.eos_token_ids))


@dataclass(frozen=True)
class ReplicaConfig:
    #: NamedModel or GivenModel
    loader: Any
    #: the server's ``suffix`` config: the shared tree's depth and bound
    suffix: Any
    #: runner slots per replica (``--parallel``)
    slots: int = 1
    #: torch threads per replica
    threads: int = 1
    #: sequences waiting in a replica's queue (the ingress bounds the total)
    max_queue: int = 32
    #: seconds a replica may draft without the other replicas' newest responses
    sync_interval: float = 0.5
    #: False: each replica learns only from its own responses (measures what sharing gains)
    shared_memory: bool = True
    #: the shared memory's file (``--suffix-cache``): loaded at start, saved on shutdown
    suffix_cache: str | None = None
    #: proposer memory each slot keeps (``--proposer-memory-mb``, in bytes)
    proposer_budget: int = 128 * 2**20
    #: each replica's batching (``--draft-budget``, ``--max-draft-rows``, ``--prefill-rows``)
    batching: Batching = Batching()
    #: each replica's prompt store (``--prompt-cache-mb``, in bytes; 0: no prompt cache)
    prompt_cache_bytes: int = 0


class EngineReplica:
    """One Serve replica: a model, its slots and scheduler, and its synced memory."""

    def __init__(self, config: ReplicaConfig):
        import torch

        from specdecode.api import encode_prompt
        from specdecode.server.shared_memory import memory_actor

        torch.set_num_threads(config.threads)
        runners, tokenizer, eos = config.loader.load(config.slots)
        if config.shared_memory:  # the first of the replicas and the ingress creates it
            actor = memory_actor(config.suffix_cache, config.suffix, NAMESPACE)
            self.memory = SyncedMemory(actor, config.suffix, config.sync_interval)
        else:
            self.memory = SharedMemory(None, config.suffix)
        metrics = Metrics()
        prompt_cache = (PromptCache(config.prompt_cache_bytes, metrics)
                        if config.prompt_cache_bytes else None)
        self.scheduler = Scheduler(runners, tokenizer, eos, self.memory.make_proposer,
                                   config.max_queue, metrics, config.proposer_budget,
                                   config.batching, prompt_cache)
        self.tokenizer = tokenizer
        self.model = ModelInfo.of(runners[0])
        # the first forward of a process pays one-off costs; keep them out of the first request
        runners[0].prefill(encode_prompt(tokenizer, "Hello", chat=True))
        self.scheduler.start()

    def describe(self) -> tuple[ModelInfo, Any]:
        """What the ingress needs to check and encode requests: limits and tokenizer."""
        return self.model, self.tokenizer

    def check_health(self) -> None:
        """Serve calls this periodically; a dead scheduler thread gets the replica replaced."""
        if not self.scheduler.alive:
            raise RuntimeError("the decode scheduler has stopped")

    async def generate(self, specs: list[SequenceSpec]):
        """Stream ``(kind, index, payload)`` events as the local scheduler posts them; errors
        travel as ``ApiError`` fields (an exception with extra arguments does not pickle).
        Closing the stream (the client left) cancels the sequences. The first request of a
        replica always pulls the shared memory (a restarted one drafts from all of it)."""
        if isinstance(self.memory, SyncedMemory):
            await self.memory.pull()
        job = Job(specs, asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except ApiError as exc:
            for index in range(len(specs)):
                yield "error", index, _error_fields(exc)
            return
        left = len(specs)
        try:
            while left:
                kind, index, payload = await job.events.get()
                if kind in ("done", "error"):
                    left -= 1
                    payload = _error_fields(payload) if kind == "error" else payload
                elif kind == "start":
                    payload = os.getpid()  # which replica serves it: ReplicaPool.serving
                yield kind, index, payload
        finally:
            job.cancel()

    def memory_stats(self) -> dict:
        """What syncing the memory cost this replica so far (pushes, pulls and seconds), and
        the responses in its tree."""
        costs = getattr(self.memory, "costs", {})
        return dict(costs, cached_responses=len(self.memory.global_cache.cached_requests))

    def __del__(self):  # Serve's graceful shutdown: every proposer sees ``finish``
        scheduler = getattr(self, "scheduler", None)  # None: the constructor failed
        if scheduler is not None:
            scheduler.stop(timeout=5)


def _error_fields(exc: ApiError) -> dict:
    return {"status": exc.status, "message": exc.message, "param": exc.param, "code": exc.code,
            "kind": exc.kind, "headers": exc.headers}


@dataclass
class _Choice:
    """One choice of a job, across attempts."""

    #: waiting -> running -> finished
    state: str = "waiting"
    #: the text the client has
    sent: str = ""
    #: the replica process generating it (0: none)
    pid: int = 0


class ReplicaPool:
    """The routes' backend over a Serve deployment handle: admission (429 beyond
    ``parallel + max_queue`` sequences, as the local scheduler), one streaming call per job,
    retries on another replica when one dies, and the sequence metrics of the local server."""

    def __init__(self, handle, replicas: int, slots: int, max_queue: int, metrics: Metrics):
        self.handle = handle
        self._stream = handle.options(stream=True)
        self.replicas = replicas
        self.parallel = replicas * slots
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting = 0
        self.running = 0
        #: jobs sent again after their replica died, and choices that failed for good
        self.retries = 0
        self.failures = 0
        #: replica process id -> sequences it is generating now
        self.serving: collections.Counter = collections.Counter()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False

    def start(self) -> None:
        """The replicas are up before the routes start (``serve.run`` waits for them)."""
        self._stopping = False

    @property
    def alive(self) -> bool:
        return not self._stopping

    def load(self) -> dict[str, int]:
        return {"running": self.running, "waiting": self.waiting, "parallel": self.parallel,
                "max_queue": self.max_queue, "replicas": self.replicas,
                "retries": self.retries, "failures": self.failures}

    def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.get_loop().call_soon_threadsafe(task.cancel)

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise ApiError(503, "the server is shutting down", kind="server_error",
                           code="shutting_down")
        busy = self.waiting + self.running
        if max(0, busy + len(job.specs) - self.parallel) > self.max_queue:
            raise ApiError(
                429, f"the server is busy: {self.running} sequences running and {self.waiting} "
                     f"waiting (queue limit {self.max_queue}); retry later",
                kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        self.waiting += len(job.specs)
        self._gauges()
        task = asyncio.get_running_loop().create_task(self._serve(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _gauges(self) -> None:
        self.metrics.queued.set(self.waiting)
        self.metrics.active.set(self.running)

    async def _serve(self, job: Job) -> None:
        choices = [_Choice() for _ in job.specs]
        try:
            if await self._attempts(job, choices):  # the rest was cancelled: the client left
                self._finish_rest(job, choices, "cancelled")
        except asyncio.CancelledError:
            self._finish_rest(job, choices, "error", ApiError(
                503, "the server is shutting down", kind="server_error", code="shutting_down"))
            raise
        except Exception as exc:
            log.exception("a replica failed")
            self._finish_rest(job, choices, "error",
                              ApiError(500, f"internal error: {exc}", kind="server_error"))

    async def _attempts(self, job: Job, choices: list[_Choice]) -> bool:
        """Stream ``job`` from a replica, and again from another when that one dies (up to
        ``ATTEMPTS`` in all). False where it failed for good: its choices then end with 503."""
        for attempt in range(ATTEMPTS):
            replayed = [""] * len(choices)  # this attempt's text, per choice
            try:
                async for kind, index, payload in self._events(job):
                    self._on_event(job, choices, replayed, kind, index, payload)
                return True
            except _Diverged:
                self._fail(job, choices, "the replica serving this request failed and the "
                                         "retry's output differs from the text already sent "
                                         "(an unseeded sampled request); send it again")
                return False
            except Exception as exc:
                if not _replica_died(exc):
                    raise
                for choice in choices:
                    self._move(choice, 0)
                log.warning("a replica died serving a request (attempt %d of %d): %s",
                            attempt + 1, ATTEMPTS, type(exc).__name__)
                if attempt + 1 < ATTEMPTS:
                    self.retries += 1
        self._fail(job, choices, f"{ATTEMPTS} replicas failed serving this request; retry later")
        return False

    def _on_event(self, job: Job, choices: list[_Choice], replayed: list[str], kind: str,
                  index: int, payload) -> None:
        """One event of a replica's stream, passed on to the job; text the client already has
        from a failed attempt is not sent again (:class:`_Diverged` where the retry differs)."""
        choice = choices[index]
        if choice.state == "finished":
            return  # finished in an earlier attempt
        if kind == "start":
            self._move(choice, payload)
            if choice.state == "waiting":
                choice.state = "running"
                self.waiting -= 1
                self.running += 1
                self._gauges()
                self.metrics.queue_wait.observe(time.perf_counter() - job.arrived)
                job.post("start", index)
        elif kind == "text":
            replayed[index] += payload
            text, done = replayed[index], choice.sent
            if len(text) <= len(done):
                return  # the client has this part from the failed attempt
            if not text.startswith(done):
                raise _Diverged()
            choice.sent = text
            job.post("text", index, text[len(done):])
        elif kind == "done":
            self._finish(job, choices, index, "done", payload)
        elif kind == "error":
            self._finish(job, choices, index, "error", ApiError(**payload))

    def _move(self, choice: _Choice, pid: int) -> None:
        """``choice`` is generated by replica ``pid`` now (0: by none): ``serving`` follows."""
        if choice.pid:
            self.serving[choice.pid] -= 1
            if self.serving[choice.pid] <= 0:
                del self.serving[choice.pid]
        if pid:
            self.serving[pid] += 1
        choice.pid = pid

    def _finish(self, job: Job, choices: list[_Choice], index: int, kind: str,
                payload=None) -> None:
        """Choice ``index`` ends (``kind``: done, error or cancelled): counts, gauges, metrics,
        and the job's last event for it."""
        choice = choices[index]
        method = job.specs[index].method.name
        if choice.state == "running":
            self.running -= 1
        elif choice.state == "waiting":
            self.waiting -= 1
        choice.state = "finished"
        self._move(choice, 0)
        self._gauges()
        if kind == "done":
            self.metrics.observe_sequence(method, payload.finish_reason, payload.stats)
            job.post("done", index, payload)
        elif kind == "error":
            self.metrics.observe_sequence(method, "error", None)
            job.post("error", index, payload)
        else:
            self.metrics.observe_sequence(method, "cancelled", None)

    def _finish_rest(self, job: Job, choices: list[_Choice], kind: str, payload=None) -> None:
        for index, choice in enumerate(choices):
            if choice.state != "finished":
                self._finish(job, choices, index, kind, payload)

    def _fail(self, job: Job, choices: list[_Choice], message: str) -> None:
        self.failures += sum(choice.state != "finished" for choice in choices)
        self._finish_rest(job, choices, "error", ApiError(503, message, kind="server_error",
                                                          code="replica_failed"))

    async def _events(self, job: Job):
        """One streaming call to a replica, as an async iterator of events; stops (and cancels
        the call) when the job is cancelled, checked every DISCONNECT_POLL_S."""
        stream = self._stream.generate.remote(job.specs)
        pending = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
                if done:
                    try:
                        event = pending.result()
                    except StopAsyncIteration:
                        return
                    yield event
                    pending = asyncio.ensure_future(stream.__anext__())
                if job.cancelled.is_set():
                    return
        finally:
            if pending.done():
                if not pending.cancelled():
                    pending.exception()  # retrieved: the stream's end is no error
            else:
                pending.cancel()
            stream.cancel()


class _Diverged(Exception):
    """A retried sequence produced text other than what the client already has."""


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, RayActorError)


def require_ray() -> None:
    """A clear one-line error (exit status 2) when Ray Serve is not installed."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise SpecDecodeError("--replicas needs Ray Serve, which is not installed: "
                              "pip install 'specdecode[ray]'") from None


def start_ray(replicas: int, threads: int, address: str | None) -> None:
    """Join the cluster at ``address``, or start a local one sized for the replicas (no
    dashboard). Serve's own HTTP proxy stays off: the ingress (``--host``) is ours."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            ray.init(num_cpus=replicas * threads, include_dashboard=False,
                     namespace=NAMESPACE, log_to_driver=False)
    serve.start(proxy_location="Disabled")


def engine_deployment(config: ReplicaConfig, replicas: int):
    """The engine replicas as a Serve deployment (one CPU reservation per torch thread)."""
    from ray import serve

    return serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": config.threads},
        max_ongoing_requests=config.slots + config.max_queue,
        health_check_period_s=1, graceful_shutdown_timeout_s=5)


def frontend(handle, model: ModelInfo, tokenizer, config: ReplicaConfig, replicas: int,
             settings: Settings) -> Frontend:
    """The routes' state over a handle to the engine replicas."""
    from specdecode.server.shared_memory import RemoteMemory, memory_actor

    if config.shared_memory:
        memory = RemoteMemory(memory_actor(config.suffix_cache, config.suffix, NAMESPACE),
                              config.suffix_cache)
    else:
        memory = SharedMemory()  # nothing shared, nothing saved
    metrics = Metrics()
    pool = ReplicaPool(handle, replicas, config.slots, settings.max_queue, metrics)
    return Frontend(pool, model, tokenizer, settings, metrics, memory)


def deploy(config: ReplicaConfig, replicas: int, settings: Settings) -> Frontend:
    """Start ``replicas`` engine replicas (Ray must be initialised) and return the routes'
    state over them, for an ingress in this process. Blocks until every replica is up."""
    from ray import serve

    handle = serve.run(engine_deployment(config, replicas).bind(config), name=APP_NAME,
                       route_prefix=None)
    model, tokenizer = handle.describe.remote().result()
    return frontend(handle, model, tokenizer, config, replicas, settings)


class ServeIngress:
    """The routes as a Serve deployment, for ``serve run`` / a Serve config file: Serve's HTTP
    proxy in front, the engine replicas behind ``engine`` (a deployment handle)."""

    def __init__(self, engine, config: ReplicaConfig, replicas: int, settings: Settings):
        self.engine = engine
        self.config = config
        self.replicas = replicas
        self.settings = settings

    async def __serve_build_asgi_app__(self):
        from specdecode.server.app import create_app

        model, tokenizer = await self.engine.describe.remote()
        return create_app(frontend(self.engine, model, tokenizer, self.config, self.replicas,
                                   self.settings))


def ingress_deployment():
    from ray import serve

    return serve.deployment(serve.ingress()(ServeIngress), name="Ingress",
                            ray_actor_options={"num_cpus": 0})


def replica_config(args, suffix) -> ReplicaConfig:
    """The engine replicas' :class:`ReplicaConfig` for ``serve --replicas``, checked
    (Ray Serve installed, a loadable ``--suffix-cache``) before any replica starts."""
    from specdecode.server.options import batching_of

    if args.replicas < 1:
        raise SpecDecodeError(f"--replicas must be a positive number (0, the default: one "
                              f"process without Ray), got {args.replicas}")
    if args.sync_interval < 0:
        raise SpecDecodeError(f"--sync-interval must be >= 0, got {args.sync_interval}")
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // args.replicas)
    if threads < 1:
        raise SpecDecodeError(f"--threads-per-replica must be >= 1, got {threads}")
    require_ray()
    if args.suffix_cache is not None and not args.shared_memory:
        raise SpecDecodeError("--suffix-cache saves the shared memory; drop --no-shared-memory")
    if args.suffix_cache is not None:  # a bad file fails here, not in a replica
        SharedMemory(args.suffix_cache, suffix)
    return ReplicaConfig(
        NamedModel(args.model, args.runner, args.weights), suffix, args.parallel,
        threads, args.max_queue, args.sync_interval, args.shared_memory,
        None if args.suffix_cache is None else str(args.suffix_cache),
        args.proposer_memory_mb * 2**20, batching_of(args), args.prompt_cache_mb * 2**20)


def app(args: dict[str, str]):
    """The whole server as one Serve application, for Ray's own tools::

        serve run specdecode.server.ray_serve:app replicas=2 model=smollm2 suffix_cache=/path

    Every ``specdecode serve`` option is a ``key=value`` (dashes or underscores;
    ``no_shared_memory=true`` for the flag); ``host``/``port`` are Serve's (its HTTP proxy,
    port 8000 by default), ``ray_address`` is ``serve run``'s ``--address``."""
    import argparse

    from specdecode.server.options import add_arguments, settings_of

    parser = argparse.ArgumentParser(prog="specdecode.server.ray_serve:app")
    add_arguments(parser)
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if flag == "--no-shared-memory":
            argv += [flag] if str(value).lower() in ("1", "true", "yes") else []
        else:
            argv.append(f"{flag}={value}")
    parsed = parser.parse_args(argv)
    settings, suffix = settings_of(parsed)
    config = replica_config(parsed, suffix)
    engine = engine_deployment(config, parsed.replicas).bind(config)
    return ingress_deployment().bind(engine, config, parsed.replicas, settings)


def shutdown() -> None:
    """Stop the replicas and the memory actor (after the routes saved it)."""
    import ray
    from ray import serve

    from specdecode.server.shared_memory import MEMORY_ACTOR

    serve.delete(APP_NAME)
    try:
        ray.kill(ray.get_actor(MEMORY_ACTOR, namespace=NAMESPACE))
    except ValueError:  # already gone
        pass
