"""``specdecode serve``: an OpenAI-compatible HTTP server with lossless speculative decoding.

    specdecode serve                                  # default model and method, 127.0.0.1:8000
    specdecode serve --method suffix --suffix-cache ~/.cache/specdecode/suffix.bin

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming with ``stream:
true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). A request picks
its method with the model alias ``smollm2+ngram`` or ``"specdecode": {"method": "ngram",
"config": {...}}``; ``usage`` carries its speculation statistics.

Layout: :mod:`.protocol` (OpenAI schemas and errors), :mod:`.scheduler` (runner slots, bounded
queue, round-robin stepping, long prompts prefilled in parts), :mod:`.app` (routes, streaming,
Host and content-type checks), :mod:`.limits` (what a request's method config may ask for),
:mod:`.artifacts` (the trained artifacts requests pick by name), :mod:`.metrics`,
:mod:`.memory` (the suffix proposer's global tree shared by every request, saved and loaded),
:mod:`.loadtest`. With ``--replicas N`` (Ray Serve): :mod:`.ray_serve` (engine replicas behind
the same routes) and :mod:`.shared_memory` (one suffix memory for every replica).
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time
from pathlib import Path

from specdecode.errors import SpecDecodeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.cli import add_model_arguments
    from specdecode.server.goodput import DRAFT_BUDGETS, Batching

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--method", default=None,
                        help="method of requests that name none (see `specdecode methods`); "
                             "default: the fastest")
    parser.add_argument("-c", "--config", action="append", default=[], metavar="KEY=VALUE",
                        help="config field of the default method (repeatable)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: from --model)")
    parser.add_argument("--parallel", type=int, default=4,
                        help="sequences generated at once, each on its own KV cache over shared "
                             "weights, all in one forward a step on the native runner (in turn "
                             "on hf; 1 = strictly one after another)")
    parser.add_argument("--draft-budget", choices=DRAFT_BUDGETS, default="goodput",
                        help="goodput: each step caps every sequence's draft by expected tokens "
                             "per second of the whole forward (drafts shrink as the batch "
                             "grows, down to none); full: drafts as the methods make them")
    parser.add_argument("--max-draft-rows", type=int, default=Batching.max_draft_rows,
                        help="most draft rows one sequence sends in one step")
    parser.add_argument("--prefill-rows", type=int, default=Batching.prefill_rows,
                        help="most prompt rows one step prefills beside the decoding "
                             "sequences, all new requests together")
    parser.add_argument("--max-queue", type=int, default=32,
                        help="sequences that may wait for a slot; beyond it requests get 429")
    parser.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                        help="largest request body accepted (413 beyond)")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens of requests that give none")
    parser.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                        help="comma-separated Host header names to answer, '*' for any (default: "
                             "localhost, 127.0.0.1 and ::1 when --host is a loopback address, "
                             "else any); other names get 421, so a web page cannot reach the "
                             "server through DNS rebinding")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="let web pages from ORIGIN (e.g. http://localhost:3000) call the "
                             "API (repeatable; default: no CORS, browsers keep pages out)")
    parser.add_argument("--artifact", action="append", default=[], metavar="NAME=PATH",
                        help="offer a trained artifact (heads, exit adapters, a draft model "
                             "file or checkpoint folder) to requests under NAME (repeatable); "
                             "requests pick artifacts by name only, among these and those "
                             "found for the model in the package and the user cache")
    parser.add_argument("--proposer-memory-mb", type=int, default=128,
                        help="proposer memory each slot keeps for per-request method configs "
                             "(least recently used dropped first); a request whose config "
                             "needs more gets 400")
    parser.add_argument("--suffix-cache", type=Path, default=None, metavar="PATH",
                        help="load the suffix proposer's global tree from PATH at start (when it "
                             "exists) and save it there on shutdown")
    group = parser.add_argument_group(
        "replicas (Ray Serve; needs pip install 'specdecode[ray]', see docs/server.md)")
    group.add_argument("--replicas", type=int, default=0,
                       help="serve from N engine replicas on Ray Serve, each with its own model "
                            "and --parallel slots, sharing one suffix memory (0: one process, "
                            "no Ray)")
    group.add_argument("--threads-per-replica", type=int, default=None,
                       help="torch threads of each replica (default: CPU cores / replicas)")
    group.add_argument("--sync-interval", type=float, default=0.5,
                       help="seconds a replica may draft without the other replicas' newest "
                            "responses (it pulls them before a request when older; 0: always)")
    group.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                       help="each replica learns only from its own responses (to measure what "
                            "the shared memory gains)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. 'auto' after `ray start --head`) "
                            "instead of starting a local one")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    add_model_arguments(parser)


def served_name(model: str) -> str:
    from specdecode.models.loading import DEFAULT_MODEL

    if model in (DEFAULT_MODEL, "default"):
        return DEFAULT_MODEL
    return Path(model).stem or model


def settings_of(args: argparse.Namespace):
    """(Settings, the server's ``suffix`` config) for parsed ``serve`` arguments, checked."""
    from specdecode import registry
    from specdecode.cli import parse_config
    from specdecode.server.app import Settings
    from specdecode.server.goodput import Batching

    settings = Settings(
        model_id=args.served_model_name or served_name(args.model),
        method=args.method or registry.DEFAULT_METHOD, config=parse_config(args.config),
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        allowed_hosts=allowed_hosts(args.allowed_hosts, args.host),
        cors_origins=tuple(args.cors_origin), artifacts=artifact_paths(args.artifact),
        proposer_memory_bytes=args.proposer_memory_mb * 2**20,
        batching=Batching(args.draft_budget, args.max_draft_rows, args.prefill_rows))
    registry.get(settings.method).make_config(settings.config)
    for flag in ("parallel", "max_body_bytes", "default_max_tokens", "proposer_memory_mb"):
        if getattr(args, flag) < 1:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_queue < 0:
        raise SpecDecodeError(f"--max-queue must be >= 0, got {args.max_queue}")
    suffix = registry.get("suffix").make_config(
        settings.config if settings.method == "suffix" else {})
    return settings, suffix


def allowed_hosts(names: str | None, host: str) -> tuple[str, ...] | None:
    """``--allowed-hosts`` -> the Host names answered (None: any)."""
    import ipaddress

    from specdecode.server.app import LOOPBACK_HOSTS

    if names is None:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name other than localhost
            loopback = False
        return LOOPBACK_HOSTS if loopback else None
    listed = tuple(n.strip().lower() for n in names.split(",") if n.strip())
    if "*" in listed:
        return None
    if not listed:
        raise SpecDecodeError("--allowed-hosts needs at least one name (or '*' for any)")
    return listed


def artifact_paths(pairs: list[str]) -> dict[str, str]:
    """``--artifact NAME=PATH`` flags -> {name: path}, each path checked to exist."""
    out = {}
    for pair in pairs:
        name, eq, path = pair.partition("=")
        if not eq or not name or not path:
            raise SpecDecodeError(f"--artifact takes NAME=PATH, got {pair!r}")
        if not Path(path).expanduser().exists():
            raise SpecDecodeError(f"--artifact {pair}: no such file or folder")
        out[name] = path
    return out


def build(args: argparse.Namespace):
    """The app for parsed ``serve`` arguments: loads the model, checks everything else
    first so bad flags fail in a second, not after the model load."""
    from specdecode.api import eos_ids
    from specdecode.models.loading import load_model, make_runner
    from specdecode.server.app import Server, create_app
    from specdecode.server.memory import SharedMemory

    settings, suffix = settings_of(args)
    if args.replicas:
        from specdecode.server import ray_serve

        config = replica_config(args, suffix)
        ray_serve.start_ray(args.replicas, config.threads, args.ray_address)
        return create_app(ray_serve.deploy(config, args.replicas, settings))
    memory = SharedMemory(args.suffix_cache, suffix)
    loaded = load_model(args.model)
    first = make_runner(loaded, args.runner, args.weights, args.max_context)
    runners = [first] + [first.replica() for _ in range(args.parallel - 1)]
    eos = eos_ids(loaded, loaded.tokenizer)
    server = Server(runners, loaded.tokenizer, eos, settings, memory)
    # the first forward of a process pays one-off costs; keep them out of the first request
    runners[0].prefill(server.encode("Hello", chat=True))
    return create_app(server)


def replica_config(args: argparse.Namespace, suffix):
    """The engine replicas' :class:`~.ray_serve.ReplicaConfig` for ``--replicas``, checked
    (Ray Serve installed, a loadable ``--suffix-cache``) before any replica starts."""
    import os

    if args.replicas < 1:
        raise SpecDecodeError(f"--replicas must be a positive number (0, the default: one "
                              f"process without Ray), got {args.replicas}")
    if args.sync_interval < 0:
        raise SpecDecodeError(f"--sync-interval must be >= 0, got {args.sync_interval}")
    threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // args.replicas)
    if threads < 1:
        raise SpecDecodeError(f"--threads-per-replica must be >= 1, got {threads}")
    from specdecode.server import ray_serve
    from specdecode.server.goodput import Batching

    ray_serve.require_ray()
    if args.suffix_cache is not None and not args.shared_memory:
        raise SpecDecodeError("--suffix-cache saves the shared memory; drop --no-shared-memory")
    if args.suffix_cache is not None:  # a bad file fails here, not in a replica
        from specdecode.server.memory import SharedMemory

        SharedMemory(args.suffix_cache, suffix)
    return ray_serve.ReplicaConfig(
        ray_serve.NamedModel(args.model, args.runner, args.weights), suffix, args.parallel,
        threads, args.max_queue, args.sync_interval, args.shared_memory,
        None if args.suffix_cache is None else str(args.suffix_cache),
        args.proposer_memory_mb * 2**20, Batching(args.draft_budget, args.max_draft_rows,
                                                 args.prefill_rows))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build(args)
    server = app.state.server
    print(f"specdecode serve: http://{args.host}:{args.port}/v1 (model "
          f"'{server.settings.model_id}', method '{server.settings.method}')"
          + (f", {args.replicas} replicas" if args.replicas else "")
          + (f", suffix cache {server.memory.path}" if server.memory.path else ""), flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        if args.replicas:
            from specdecode.server import ray_serve

            ray_serve.shutdown()
    return 0


class BackgroundServer:
    """Serve an app on loopback from a thread (tests, load tests, measurements)::

        with BackgroundServer(app) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # port 0: the OS picks a free one, no race
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name="specdecode-uvicorn")

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
