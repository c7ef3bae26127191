"""The servers ``scripts/serving_bench.py`` measures, each a child process on loopback.

- ``specdecode serve --parallel N --max-context C --method M`` with ``OMP_NUM_THREADS`` set to
  the run's threads (torch and our kernels follow it);
- llama.cpp's ``llama-server --parallel N -c N*C -t T -tb T`` on the same GGUF file, found as
  :func:`.llama_tools.find_tool` finds llama.cpp's tools. Without ``--kv-unified`` (its default
  when ``--parallel`` is given) it splits ``-c`` evenly among its slots, so each slot holds the
  same ``C`` positions as each of ours. It keeps its slots' prompt cache (``--cache-prompt``,
  its default, as ours keeps its own) unless asked not to (the multi-turn bench), and applies
  the model's own chat template (``--jinja``, which tools need).

A :class:`ServerProcess` is a context manager: the process is stopped on leaving it, error or
not (SIGINT, then SIGKILL after a grace period), and on Linux it also dies with the benchmark
(``PR_SET_PDEATHSIG``) if the benchmark itself is killed. Its peak resident memory is read
from ``/proc/PID/status`` (``VmHWM``: the high-water mark since it started).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specdecode.bench.llama_tools import TOOLS_ENV, find_tool
from specdecode.errors import SpecDecodeError, require
from specdecode.server.loadtest import stop_server, wait_healthy

OURS = "specdecode"
LLAMA_SERVER = "llama-server"
#: seconds a server may take to load and answer /health
START_TIMEOUT = 600.0


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration of the sweep: ``kind`` (OURS or LLAMA_SERVER) and, for ours,
    the method (None: the server's default method)."""

    kind: str
    method: str | None = None
    #: extra command-line arguments, appended last
    extra: tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        return self.kind if self.kind == LLAMA_SERVER else f"{self.kind} {self.method}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_binary(directory: str | None) -> Path:
    tool = find_tool("llama-server", directory)
    require(tool is not None, f"llama-server not found (--llama-cpp DIR, ${TOOLS_ENV} or PATH); "
                              "docs/bench.md builds it, or leave it out with --servers ar,default")
    return tool


def command(spec: ServerSpec, port: int, parallel: int, context: int, threads: int, model: str,
            gguf: Path | None, llama_server: Path | None, cache_prompt: bool = True) -> list[str]:
    """The argv of ``spec``'s server with ``parallel`` slots of ``context`` positions each;
    ``cache_prompt``: llama-server keeps its slots' prompt cache (ours is set by its flags)."""
    if spec.kind == OURS:
        argv = [sys.executable, "-m", "specdecode.cli", "serve", "--host", "127.0.0.1",
                "--port", str(port), "--model", model, "--parallel", str(parallel),
                "--max-context", str(context), "--max-queue", str(max(32, 2 * parallel)),
                "--log-level", "warning"]
        if spec.method is not None:
            argv += ["--method", spec.method]
        return argv + list(spec.extra)
    require(llama_server is not None and gguf is not None,
            "llama-server needs its binary and a GGUF file")
    return [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "-c", str(parallel * context), "-t", str(threads),
            "-tb", str(threads), "--cache-prompt" if cache_prompt else "--no-cache-prompt",
            "--jinja", "--no-webui", "--metrics", "--log-disable", *spec.extra]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    def __init__(self, argv: list[str], port: int, threads: int, log: Path | None = None):
        self.argv = argv
        self.url = f"http://127.0.0.1:{port}"
        self.threads = threads
        self.log = log
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        sink = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                self.argv, env=env, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        finally:
            if self.log:
                sink.close()
        try:
            wait_healthy(self.url, START_TIMEOUT, self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            stop_server(self.process, timeout=30)

    @property
    def pid(self) -> int:
        return self.process.pid

    def model_name(self) -> str:
        """The first model id of ``GET /v1/models`` (what requests must name for our server)."""
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def peak_rss_mb(self) -> float | None:
        return peak_rss_mb(self.pid)


def peak_rss_mb(pid: int) -> float | None:
    """``VmHWM`` of process ``pid`` in MiB (None where /proc cannot tell)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def busy(url: str, kind: str) -> int | None:
    """Sequences the server is still working on or holding in its queue (None: unknown).
    Ours: ``/health``'s running + waiting; llama-server: its ``/slots`` that are processing
    plus its deferred requests."""
    try:
        if kind == OURS:
            load = httpx.get(url + "/health", timeout=10).json()
            return int(load["running"]) + int(load["waiting"])
        slots = httpx.get(url + "/slots", timeout=10).json()
        return sum(1 for s in slots if s.get("is_processing"))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def wait_idle(url: str, kind: str, timeout: float = 30.0) -> int | None:
    """Poll until nothing is busy; the last count seen (0: idle)."""
    deadline = time.monotonic() + timeout
    while True:
        count = busy(url, kind)
        if count == 0 or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def sequence_outcomes(url: str) -> dict[str, float]:
    """Our server's ``specdecode_sequences_total`` by outcome (stop, length, cancelled, error),
    summed over methods; empty where the metrics cannot be read."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("specdecode_sequences_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = counts.get(outcome, 0.0) + float(value)
    return counts


def version(kind: str, llama_server: Path | None) -> str:
    if kind == OURS:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return f"specdecode {package_version('specdecode')}"
        except PackageNotFoundError:
            return "specdecode (not installed)"
    try:
        done = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SpecDecodeError(f"llama-server --version failed: {exc}") from None
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "version" in line]
    return lines[0].strip() if lines else "llama-server (version unknown)"
