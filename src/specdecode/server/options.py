"""The ``specdecode serve`` options: the flags, and the checked :class:`~.frontend.Settings` they
make. Below both users: the ``serve`` command (:mod:`specdecode.server`) and Ray Serve's entry
point (:func:`.ray_serve.app`) parse the same flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.errors import SpecDecodeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.cli_options import add_draft_budget_argument, add_model_arguments
    from specdecode.server.goodput import Batching

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
    add_draft_budget_argument(parser)
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
    add_memory_arguments(parser)
    add_dllm_argument(parser)
    add_replica_arguments(parser)
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    add_model_arguments(parser)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """What the server keeps of earlier requests: the prompt cache and the suffix tree."""
    parser.add_argument("--prompt-cache-mb", type=int, default=1024,
                        help="memory for the rows of earlier prompts and answers that the slots "
                             "wrote over, kept for requests that start with them (least "
                             "recently used dropped first); the slots' own rows are reused "
                             "besides; 0: no prompt cache, every prompt prefilled whole")
    parser.add_argument("--responses-kept", type=int, default=256, metavar="N",
                        help="responses of the Responses API kept in memory for "
                             "previous_response_id and GET /v1/responses/{id} (least recently "
                             "used dropped first; 0: none)")
    parser.add_argument("--prompt-cache-file", default=None, metavar="PATH",
                        help="read the prompt cache from PATH at start (when it exists and was "
                             "written for this model file, format and kernels) and write it "
                             "there on shutdown: long prompts stay cached across restarts")
    parser.add_argument("--suffix-cache", type=Path, default=None, metavar="PATH",
                        help="load the suffix proposer's global tree from PATH at start (when it "
                             "exists) and save it there on shutdown")


def add_dllm_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dllm", default="none", metavar="PATH",
                        help="serve the diffusion policies (method diffusion:POLICY, "
                             "docs/diffusion.md) with this dLLM delta: 'auto' the newest trained "
                             "for the model (the packaged one for SmolLM2), or a file; 'none' "
                             "(default): no dLLM is loaded and those methods are refused")


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """``--replicas`` and the options that only matter with it (:mod:`.ray_serve`)."""
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


def served_name(model: str) -> str:
    """The model id clients name: a named model's name (``qwen2.5-coder-1.5b``, not a stem cut
    at its last dot), a file's or folder's stem."""
    from specdecode.models.loading import DEFAULT_MODEL, NAMED_MODELS

    if model == "default":
        return DEFAULT_MODEL
    if model in NAMED_MODELS:
        return model
    return Path(model).stem or model


def settings_of(args: argparse.Namespace):
    """(Settings, the server's ``suffix`` config) for parsed ``serve`` arguments, checked."""
    from specdecode import registry
    from specdecode.cli_options import parse_config
    from specdecode.server.frontend import Settings

    settings = Settings(
        model_id=args.served_model_name or served_name(args.model),
        method=args.method or registry.DEFAULT_METHOD, config=parse_config(args.config),
        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        allowed_hosts=allowed_hosts(args.allowed_hosts, args.host),
        cors_origins=tuple(args.cors_origin), artifacts=artifact_paths(args.artifact),
        proposer_memory_bytes=args.proposer_memory_mb * 2**20, batching=batching_of(args),
        prompt_cache_bytes=args.prompt_cache_mb * 2**20, prompt_cache_file=args.prompt_cache_file,
        responses_kept=args.responses_kept)
    registry.get(settings.method).make_config(settings.config)
    for flag in ("parallel", "max_body_bytes", "default_max_tokens", "proposer_memory_mb"):
        if getattr(args, flag) < 1:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_queue", "prompt_cache_mb", "responses_kept"):
        if getattr(args, flag) < 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.prompt_cache_file and (args.replicas or not args.prompt_cache_mb):
        raise SpecDecodeError("--prompt-cache-file keeps the single-process server's prompt "
                              "cache: drop it, or --replicas, or --prompt-cache-mb 0")
    if args.replicas and args.dllm != "none":
        raise SpecDecodeError("--dllm is served by the single-process server; drop --replicas "
                              "or --dllm")
    suffix = registry.get("suffix").make_config(
        settings.config if settings.method == "suffix" else {})
    return settings, suffix


def allowed_hosts(names: str | None, host: str) -> tuple[str, ...] | None:
    """``--allowed-hosts`` -> the Host names answered (None: any)."""
    import ipaddress

    from specdecode.server.frontend import LOOPBACK_HOSTS

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


def batching_of(args: argparse.Namespace):
    """``--draft-budget``, ``--max-draft-rows``, ``--prefill-rows`` -> :class:`.goodput.Batching`."""
    from specdecode.server.goodput import Batching

    return Batching(args.draft_budget, args.max_draft_rows, args.prefill_rows)
