"""``specdecode serve``: an OpenAI-compatible HTTP server with lossless speculative decoding.

    specdecode serve                                  # default model and method, 127.0.0.1:8000
    specdecode serve --method suffix --suffix-cache ~/.cache/specdecode/suffix.bin

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming with ``stream:
true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). A request picks
its method with the model alias ``smollm2+ngram`` or ``"specdecode": {"method": "ngram",
"config": {...}}``; ``usage`` carries its speculation statistics.

Layout: :mod:`.protocol` (OpenAI schemas and errors), :mod:`.scheduler` (runner slots, bounded
queue, round-robin stepping, long prompts prefilled in parts), :mod:`.frontend` (settings,
a request checked and turned into sequences), :mod:`.endpoints` (the OpenAI endpoints, JSON or
streamed), :mod:`.app` (routes, errors, Host checks), :mod:`.limits` (what a request's method
config may ask for), :mod:`.artifacts` (the trained artifacts requests pick by name), :mod:`.metrics`,
:mod:`.memory` (the suffix proposer's global tree shared by every request, saved and loaded),
:mod:`.options` (the flags, parsed and checked), :mod:`.loadtest`. With ``--replicas N`` (Ray
Serve): :mod:`.ray_serve` (engine replicas behind the same routes) and :mod:`.shared_memory` (one suffix memory for every replica).
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading
import time

# add_arguments: the ``serve`` command's flags (cli.EXTERNAL_COMMANDS reads them here)
from specdecode.server.options import add_arguments, settings_of  # noqa: F401


def build(args: argparse.Namespace):
    """The app for parsed ``serve`` arguments: loads the model, checks everything else
    first so bad flags fail in a second, not after the model load."""
    from specdecode.api import eos_ids
    from specdecode.models.loading import load_model, make_runner
    from specdecode.server.app import create_app
    from specdecode.server.frontend import Server
    from specdecode.server.memory import SharedMemory

    settings, suffix = settings_of(args)
    if args.replicas:
        from specdecode.server import ray_serve

        config = ray_serve.replica_config(args, suffix)
        ray_serve.start_ray(args.replicas, config.threads, args.ray_address)
        return create_app(ray_serve.deploy(config, args.replicas, settings))
    memory = SharedMemory(args.suffix_cache, suffix)
    loaded = load_model(args.model)
    first = make_runner(loaded, args.runner, args.weights, args.max_context)
    runners = [first] + [first.replica() for _ in range(args.parallel - 1)]
    eos = eos_ids(loaded, loaded.tokenizer)
    server = Server(runners, loaded.tokenizer, eos, settings, memory,
                    dllm=load_dllm(loaded, args.dllm, args.max_context))
    # the first forward of a process pays one-off costs; keep them out of the first request
    runners[0].prefill(server.encode("Hello", chat=True))
    return create_app(server)


def load_dllm(loaded, spec: str, max_context: int | None):
    """The dLLM ``diffusion:POLICY`` requests decode (``--dllm``), or None for 'none'; 'auto'
    without a delta trained for the model is refused with how to make one."""
    from specdecode.diffusion.dllm import dllm_runner, find_dllm
    from specdecode.errors import require
    from specdecode.server.diffusion import Dllm

    path = find_dllm(loaded, spec)
    require(path is not None or spec == "none", "--dllm auto: no dLLM delta for this model; "
                                                "train one with `specdecode train dllm`")
    if path is None:
        return None
    runner, delta = dllm_runner(loaded, path, max_context=max_context)
    return Dllm(runner, int(delta.config["mask_id"]), int(delta.config.get("block_size", 8)),
                str(path))


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
