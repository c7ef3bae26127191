"""Peers in a process of their own: a peer that crashes does not take the bench with it.

llama.cpp is C++ loaded into the process that calls it; on some CPUs a build of it dies in a
multi-token ``decode`` (a segmentation fault: exit 139) or stops at an illegal instruction
(SIGILL) - see docs/bench.md. So every llama.cpp peer runs in a child Python process:

    peer = PeerProcess("llama.cpp", "specdecode.bench.contenders:LlamaCppServed", gguf_path=...)
    outcome = peer.call("run", prompt_ids, 128, sampling_dict)   # JSON in, JSON out
    peer.close()

The child builds ``factory(**kwargs)`` once, then answers one JSON line per call on a pipe of
its own; C code that prints to stdout cannot corrupt the answers (the child points its fd 1 at
its stderr). Its stderr goes to a file, whose last line names the cause when it dies. A death,
a Python exception in the child or a call that outlives ``timeout_s`` raises
:class:`PeerFailed`, whose message says which peer failed and how:
``peer llama.cpp failed: killed by SIGSEGV (exit 139 in a shell); last stderr line: ...``.
Binaries (``llama-bench``, ``llama-perplexity``) are their own processes already; they report
through :func:`run_tool` the same way.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile

#: seconds a peer may take to build (load its model) or answer one call, by default
DEFAULT_TIMEOUT_S = 1800.0


class PeerFailed(Exception):
    """A peer died, raised in its process, or timed out; everything else in the run goes on."""

    def __init__(self, peer: str, reason: str):
        super().__init__(f"peer {peer} failed: {reason}")
        self.peer = peer
        self.reason = reason


def describe_exit(returncode: int | None, stderr_tail: str) -> str:
    """``killed by SIGSEGV (exit 139 in a shell)`` or ``exit code 3``, with the last stderr line."""
    if returncode is None:
        what = "still running"
    elif returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        what = f"killed by {name} (exit {128 - returncode} in a shell)"
    elif returncode > 128 and returncode - 128 in signal.valid_signals():
        # a shell or a wrapper that reports a signal as 128 + its number
        what = f"exit code {returncode} ({signal.Signals(returncode - 128).name})"
    else:
        what = f"exit code {returncode}"
    return what + (f"; last stderr line: {stderr_tail}" if stderr_tail else "")


def last_line(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def child_env() -> dict[str, str]:
    """The parent's environment with its import path, so the child imports the same code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


class PeerProcess:
    """One peer object in a child process; :meth:`call` runs one of its methods there."""

    def __init__(self, name: str, factory: str, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
        """``factory``: ``module:attribute``, called with ``kwargs`` (JSON values) in the child."""
        self.name = name
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "specdecode.bench.peer_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=child_env())
        self._request({"factory": factory, "kwargs": kwargs})

    def call(self, method: str, *args):
        return self._request({"method": method, "args": list(args)})

    def _request(self, message: dict):
        proc = self._proc
        if proc is None:
            raise PeerFailed(self.name, "it was closed")
        try:
            proc.stdin.write((json.dumps(message) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: the read below says how
        line = self._readline()
        if not line:
            raise self._failure()
        answer = json.loads(line)
        if "error" in answer:
            raise PeerFailed(self.name, f"raised {answer['error']}")
        return answer["result"]

    def _readline(self) -> bytes:
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                self._proc.kill()
                self._proc.wait()
                raise PeerFailed(self.name, f"no answer within {self.timeout_s:.0f} s (killed)")
        return self._proc.stdout.readline()

    def _failure(self) -> PeerFailed:
        code = self._proc.wait()
        self._stderr.seek(0)
        reason = describe_exit(code, last_line(self._stderr.read()))
        self._proc = None
        return PeerFailed(self.name, reason)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._stderr.close()


def run_tool(name: str, argv: list[str], timeout_s: float = DEFAULT_TIMEOUT_S,
             with_stderr: bool = False) -> str:
    """Run a peer's binary; its stdout (then its stderr, with ``with_stderr``), or
    :class:`PeerFailed` naming the exit and last stderr line (a crash, an illegal instruction,
    a time-out)."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PeerFailed(name, f"no result within {timeout_s:.0f} s (killed)") from None
    except OSError as exc:
        raise PeerFailed(name, f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        raise PeerFailed(name, describe_exit(done.returncode, last_line(done.stderr)))
    out = done.stdout + (done.stderr if with_stderr else b"")
    return out.decode("utf-8", "replace")


def _serve() -> int:
    """The child: build the peer, then answer calls until stdin closes."""
    import importlib

    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # C code printing to stdout lands in the stderr log, not in the answers
    sys.stdout = sys.stderr
    peer = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if "factory" in message:
                module, _, attribute = message["factory"].partition(":")
                peer = getattr(importlib.import_module(module), attribute)(**message["kwargs"])
                result = None
            else:
                result = getattr(peer, message["method"])(*message["args"])
            answer = {"result": result}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
