"""llama.cpp's ``llama-server`` as a peer of ``specdecode bench``: the tool people serve GGUF
files with, in the three configurations its users run, on the same file, threads and prompt
token ids as our methods:

- ``llama-server``: plain decoding;
- ``llama-server-ngram``: its n-gram speculation (``--spec-type ngram-mod``, its defaults);
- ``llama-server-draft``: a draft model (``-md DRAFT.gguf --spec-type draft-simple``, its
  defaults; ``--peer-draft``, by default Qwen2.5-Coder-0.5B, the draft of the model we measure
  on).

One server process a peer, one slot, prompt caching off (each turn is prefilled whole, as ours
is); each request is ``POST /completion`` with the prompt as token ids, greedy as
``temperature 0`` (llama.cpp's greedy sampler) or the run's sampling, and the tokens it returns.
Wall time is the request's, prefill included; target forwards are not exposed (its timings give
the drafted and accepted tokens, which become the mean accepted length, and its seconds on the
prompt, the report's prompt figures).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from specdecode.bench.contenders import LLAMA_CPP_THREADS, Outcome, cut
from specdecode.bench.peer_process import PeerFailed
from specdecode.bench.serving_servers import (LLAMA_SERVER, ServerProcess, ServerSpec, command,
                                              free_port)
from specdecode.sampling import SamplingParams

#: peer name -> llama-server arguments ({draft}: the draft model's file)
CONFIGS = {
    "llama-server": (),
    "llama-server-ngram": ("--spec-type", "ngram-mod"),
    "llama-server-draft": ("-md", "{draft}", "--spec-type", "draft-simple"),
}
#: seconds one request may take before the peer is failed
REQUEST_TIMEOUT = 900.0


class LlamaServerPeer:
    """One configuration of ``llama-server`` (:data:`CONFIGS`), started on first use."""

    kind = "peer"

    def __init__(self, name: str, binary: Path, gguf: Path, eos: Sequence[int], context: int,
                 draft: Path | None = None, threads: int = LLAMA_CPP_THREADS):
        self.name = name
        self.eos = frozenset(eos)
        spec = ServerSpec(LLAMA_SERVER, extra=tuple(a.format(draft=draft) for a in CONFIGS[name]))
        port = free_port()
        # the serving bench's llama-server command, with one slot
        self.argv = command(spec, port, 1, context, threads, str(gguf), gguf, binary,
                            cache_prompt=False)
        self.server = ServerProcess(self.argv, port, threads)
        self.started = False
        # one client for every request: making one costs tens of milliseconds (its TLS
        # context), which a request's wall time would count
        self.client = httpx.Client(timeout=REQUEST_TIMEOUT)

    def unsupported(self, sampling: SamplingParams) -> str | None:
        if sampling.repetition_penalty != 1.0:
            return "llama.cpp's repeat penalty looks at the last 64 tokens only"
        return None

    def fresh(self):
        return self

    def run(self, prompt_ids, max_new_tokens, sampling: SamplingParams) -> Outcome:
        if not self.started:
            try:
                self.server.__enter__()
            except Exception as exc:
                raise PeerFailed(f"{self.name} did not start: {exc}") from None
            self.started = True
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "cache_prompt": False,
                "return_tokens": True, "temperature": 0.0 if sampling.greedy else sampling.temperature,
                "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
                "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty}
        if sampling.seed is not None:
            body["seed"] = sampling.seed % 2**32
        if sampling.logit_bias:
            body["logit_bias"] = [list(pair) for pair in sampling.logit_bias]
        start = time.perf_counter()
        try:
            reply = self.client.post(self.server.url + "/completion", json=body).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PeerFailed(f"{self.name}: {exc}") from None
        wall = time.perf_counter() - start
        tokens = cut(reply.get("tokens", []), self.eos, max_new_tokens)
        timings = reply.get("timings", {})
        drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        # the prefill gives the first token; each verify step its accepted tokens and one more
        decoded = max(0, len(tokens) - 1)
        steps = max(1, decoded - accepted) if decoded else 0
        # its own seconds on the prompt: the prompt figures of the report (bench/metrics.py)
        prompt_ms = timings.get("prompt_ms")
        return Outcome(tokens, wall, 1 + steps, _lengths(decoded, steps), drafted or None,
                       prefill_s=None if prompt_ms is None else prompt_ms / 1000)

    def close(self) -> None:
        self.client.close()
        if self.started:
            self.server.stop()


def _lengths(tokens: int, steps: int) -> list[int]:
    """Per-step committed tokens summing to ``tokens`` over ``steps`` steps (llama-server gives
    the totals, not the steps: the mean is exact, the spread is not)."""
    if not steps:
        return []
    base, extra = divmod(tokens, steps)
    return [base + (i < extra) for i in range(steps)]
