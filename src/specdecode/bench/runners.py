"""``specdecode bench --runners``: what each runner and weight format costs, beside the peers.

Measured on the same machine in the same run, with the same threads:

- per-forward latency: the median time of one target forward over 1, 2, 4, 8, 16 and 64 new
  tokens (a root plus a chain draft) after a ``--context``-token prefill of real Spec-Bench
  text, for the ``hf`` runner (where the model is small enough to hold in float32) and the
  native runner in each weight format asked for, and for llama.cpp on the GGUF file: llama-cpp-python's
  ``Llama.eval`` of the same tokens with ``logits_all`` (a verify pass needs every row's
  logits) and llama.cpp's own ``llama-bench`` at the same depth (``llama_tools``), each in a
  process of its own (``peer_process``: a peer that crashes is named, the rest is kept);
- prompt processing: a ``PROMPT_TOKENS``-token prompt from an empty cache (median of
  ``PROMPT_RUNS``; shorter where a model's context is), each runner's ``prefill`` and
  llama-bench's ``pp512`` at depth 0;
- the LM head alone for each forward size (native runners): its share of a verify pass;
- the memory bound of one row: the bytes of weights a decode row streams (the native runner's
  linear layers and LM head in its format; the GGUF file's tensors for llama.cpp) over the
  machine's read bandwidth, measured here (``stream_read_gbs``), and each one-row forward's
  ratio to it;
- end-to-end ``ar`` decoding (greedy, ``--max-new-tokens``) over the first turn of each
  question: tokens/s of every runner, of ``transformers`` ``generate`` and of llama.cpp, and
  how many answers of each native format equal the fp32 native runner's token for token
  (exactness is always against the same runner; this says how far the formats drift);
- the roofline of the native int4 runner (``roofline``), on CPUs with AVX-512 VNNI.

Defaults: sizes 1, 2, 4, 8, 16, 64 (the few rows a CPU's short drafts verify, and the many
of wide trees); 9 timed forwards per size after one untimed (median); the
bandwidth is the best of 7 reads of a 512 MiB buffer.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from specdecode.bench.contenders import (LLAMA_CPP_THREADS, HFGenerate, IsolatedLlamaCpp,
                                         MethodContender, llama_cpp_available)
from specdecode.bench.report import fmt
from specdecode.bench.roofline import layer_linears, measure_roofline, roofline_markdown
from specdecode.bench.runner import encode_messages
from specdecode.draft import Draft
from specdecode.questions import Question
from specdecode.sampling import SamplingParams

FORWARD_SIZES = (1, 2, 4, 8, 16, 64)
TIMED_FORWARDS = 9
#: the prompt whose processing is timed (llama-bench's pp512), and how many times
PROMPT_TOKENS = 512
PROMPT_RUNS = 3
#: the stream-bandwidth buffer (MiB) and how many times it is read (the best counts)
STREAM_MIB = 512
STREAM_RUNS = 7
#: the llama.cpp rows: llama-cpp-python's Llama.eval (every row's logits), llama.cpp's llama-bench
LLAMA_CPP_PYTHON = "llama.cpp (llama-cpp-python)"
LLAMA_BENCH = "llama.cpp (llama-bench)"


def first_turns(tokenizer, questions: list[Question]) -> list[list[int]]:
    """Each question's first turn, chat-templated."""
    return [encode_messages(tokenizer, [{"role": "user", "content": q.turns[0]}])
            for q in questions]


def context_ids(prompts: list[list[int]], length: int) -> list[int]:
    """``length`` real tokens: the prompts end to end."""
    ids: list[int] = []
    for prompt in prompts:
        ids += prompt
        if len(ids) >= length:
            break
    while len(ids) < length:  # a tiny question file: repeat it
        ids += ids
    return ids[:length]


def median_ms(call, runs: int, after=lambda: None) -> float:
    """``call``'s median time over ``runs`` timed calls after one untimed, ms; ``after`` runs
    after each call, untimed."""
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        after()
    return statistics.median(times[1:]) * 1000


def runner_forward_ms(runner, context: list[int], tokens: list[int], size: int) -> float:
    runner.prefill(context)
    draft = Draft.chain(tokens[1:size]) if size > 1 else Draft.empty()
    # commit keeps only the root: the context grows by one token per forward
    return median_ms(lambda: runner.forward(tokens[0], draft), TIMED_FORWARDS,
                     after=lambda: runner.commit([]))


def runner_prompt_ms(runner, prompt: list[int]) -> float:
    """One prefill of ``prompt`` from an empty cache, ms (median of PROMPT_RUNS after one)."""
    return median_ms(lambda: runner.prefill(prompt), PROMPT_RUNS)


def head_ms(runner, sizes) -> dict[str, float] | None:
    """The LM head alone over ``sizes`` rows of hidden states, ms (median of TIMED_FORWARDS
    after one); None for a runner without its own head (hf)."""
    import torch

    head = getattr(runner, "head", None)
    if head is None:
        return None
    return {str(size): median_ms(lambda x=torch.randn(size, runner.shape.hidden_size): head(x),
                                 TIMED_FORWARDS) for size in sizes}


class LlamaCppLatency:
    """llama-cpp-python's per-forward latency, held in the peer's own process
    (``peer_process``): ``Llama.eval`` of the same tokens with ``logits_all``, since a verify
    pass needs every row's logits."""

    def __init__(self, gguf_path: str, n_ctx: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, logits_all=True, verbose=False)

    def forward_ms(self, context: list[int], tokens: list[int], sizes: list[int]) -> dict:
        llm = self.llm
        llm.eval(context)
        result = {}
        for size in sizes:
            times = []
            for _ in range(TIMED_FORWARDS + 1):
                llm.n_tokens = len(context)  # eval drops the KV rows past n_tokens first
                start = time.perf_counter()
                llm.eval(tokens[:size])
                times.append(time.perf_counter() - start)
            result[str(size)] = statistics.median(times[1:]) * 1000
        return result


def stream_read_gbs(mib: int = STREAM_MIB, runs: int = STREAM_RUNS) -> float:
    """The machine's memory read bandwidth, GB/s: the best of ``runs`` sums of a float32
    buffer of ``mib`` MiB (far larger than any cache), on torch's threads - the rate at which
    a forward can stream its weights at best."""
    import torch

    buffer = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def weight_bytes(runner) -> int | None:
    """Bytes of weights one decode row of a native runner streams: its LM head and every
    layer's linear layers (the embedding is read one row a token, the norms are tiny)."""
    head = getattr(runner, "head", None)
    if head is None:
        return None
    linears = [head] + [lin for layer in runner.layers for lin in layer_linears(layer)]
    return sum(lin.nbytes for lin in linears)


def _native_ar_identical(answers: dict[str, list[list[int]]], name: str) -> int | None:
    reference = answers.get("native fp32")
    if reference is None or not name.startswith("native"):
        return None
    return sum(a == b for a, b in zip(answers[name], reference))


def measure_runners(runners: dict, tokenizer, eos, questions: list[Question], context: int,
                    max_new_tokens: int, gguf_path: Path | None = None, hf_model=None,
                    llama_cpp_dir: str | None = None, threads: int = LLAMA_CPP_THREADS,
                    progress=print) -> dict:
    """Time ``runners`` (name -> runner) and, on ``gguf_path``, llama.cpp: per-forward latency,
    the memory bound of one row, greedy ``ar`` end to end; peers in processes of their own
    (a peer that fails is named in ``peers_failed``, the rest is kept)."""
    prompts = first_turns(tokenizer, questions)
    ids = context_ids(prompts, context + max(FORWARD_SIZES))
    ctx, tokens = ids[:context], ids[context:]
    failed: dict[str, str] = {}
    latency: dict[str, dict[int, float]] = {}
    prompt_ms: dict[str, float] = {}
    heads: dict[str, dict[str, float]] = {}
    # (a model of a shorter context than PROMPT_TOKENS: a prompt that fits)
    prompt_tokens = min([PROMPT_TOKENS] + [runner.max_context for runner in runners.values()])
    for name, runner in runners.items():
        latency[name] = {size: runner_forward_ms(runner, ctx, tokens, size)
                         for size in FORWARD_SIZES}
        progress(f"forward latency {name}: {latency[name]}")
        prompt_ms[name] = runner_prompt_ms(runner, context_ids(prompts, prompt_tokens))
        head = head_ms(runner, FORWARD_SIZES)
        if head is not None:
            heads[name] = head
        progress(f"prompt of {prompt_tokens} {name}: {prompt_ms[name]:.0f} ms; LM head: {head}")
    llama_decode = None
    if gguf_path is not None:
        llama_decode = _llama_cpp_latency(gguf_path, ctx, tokens, threads, llama_cpp_dir,
                                          latency, failed, progress, prompt_ms, prompt_tokens)
    memory = _memory_bound(runners, latency, gguf_path)
    roofline = (measure_roofline(runners["native int4"], FORWARD_SIZES)
                if "native int4" in runners else None)
    contenders = _ar_contenders(runners, eos, hf_model, gguf_path, prompts, max_new_tokens, failed)
    answers, totals = _ar_end_to_end(contenders, prompts, max_new_tokens, failed, progress)
    ar_rows = {name: {"tokens_per_s": new_tokens / wall, "new_tokens": new_tokens,
                      "decode_tokens_per_s": (new_tokens - len(answers[name])) / (wall - prefill)
                      if prefill is not None else None,
                      "identical_to_native_fp32": _native_ar_identical(answers, name)}
               for name, (new_tokens, wall, prefill) in totals.items()}
    if llama_decode is not None:
        ar_rows[f"{LLAMA_BENCH} tg"] = {"tokens_per_s": None, "new_tokens": None,
                                        "decode_tokens_per_s": llama_decode["tokens_per_s"],
                                        "identical_to_native_fp32": None}
    return {"context_tokens": context, "sizes": list(FORWARD_SIZES),
            "forward_ms": {name: {str(k): v for k, v in row.items()} for name, row in latency.items()},
            "prompt_tokens": prompt_tokens, "prompt_ms": prompt_ms, "head_ms": heads,
            "memory": memory, "ar": ar_rows, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "roofline": roofline, "peers_failed": failed,
            "llama_bench_command": llama_decode["command"] if llama_decode else None}


def _llama_cpp_latency(gguf_path: Path, ctx: list[int], tokens: list[int], threads: int,
                       llama_cpp_dir: str | None, latency: dict, failed: dict,
                       progress, prompt_ms: dict, prompt_tokens: int) -> dict | None:
    """llama.cpp's rows of ``latency`` (llama-cpp-python where installed, llama-bench where
    found) and llama-bench's of ``prompt_ms``, each peer in a process of its own; returns
    llama-bench's decode speed and command (None without llama-bench)."""
    from specdecode.bench.llama_tools import find_tool, llama_bench
    from specdecode.bench.peer_process import PeerFailed, PeerProcess

    if llama_cpp_available():
        try:
            peer = PeerProcess(LLAMA_CPP_PYTHON, "specdecode.bench.runners:LlamaCppLatency",
                               gguf_path=str(gguf_path), threads=threads,
                               n_ctx=len(ctx) + max(FORWARD_SIZES) + 16)
            try:
                row = peer.call("forward_ms", ctx, tokens, list(FORWARD_SIZES))
            finally:
                peer.close()
            latency[LLAMA_CPP_PYTHON] = {int(k): v for k, v in row.items()}
            progress(f"forward latency {LLAMA_CPP_PYTHON}: {row}")
        except PeerFailed as exc:
            failed[LLAMA_CPP_PYTHON] = str(exc)
    bench_tool = find_tool("llama-bench", llama_cpp_dir)
    if bench_tool is None:
        return None
    try:
        found = llama_bench(bench_tool, gguf_path, FORWARD_SIZES, len(ctx), threads)
        prompt = llama_bench(bench_tool, gguf_path, [prompt_tokens], 0, threads, gen_tokens=0)
    except PeerFailed as exc:
        failed[LLAMA_BENCH] = str(exc)
        return None
    latency[LLAMA_BENCH] = found["forward_ms"]
    prompt_ms[LLAMA_BENCH] = prompt["forward_ms"][prompt_tokens]
    progress(f"forward latency {LLAMA_BENCH}: {found['forward_ms']}; prompt of {prompt_tokens}: "
             f"{prompt_ms[LLAMA_BENCH]:.0f} ms")
    return {"tokens_per_s": found["decode_tokens_per_s"], "command": found["command"]}


def _memory_bound(runners: dict, latency: dict, gguf_path: Path | None) -> dict:
    """The machine's read bandwidth and the weight bytes each row of ``latency`` streams."""
    memory = {"stream_gbs": stream_read_gbs(), "bytes": {}}
    for name, runner in runners.items():
        memory["bytes"][name] = weight_bytes(runner)
    if gguf_path is not None:
        streamed = gguf_streamed_bytes(gguf_path)
        for name in (LLAMA_CPP_PYTHON, LLAMA_BENCH):
            if name in latency:
                memory["bytes"][name] = streamed
    return memory


def _ar_contenders(runners: dict, eos, hf_model, gguf_path: Path | None,
                   prompts: list[list[int]], max_new_tokens: int, failed: dict) -> dict:
    """Who decodes greedily end to end: every runner with ``ar``, transformers generate where
    the model is given, llama.cpp where installed (and its latency peer did not crash)."""
    from specdecode import registry
    from specdecode.bench.peer_process import PeerFailed

    ar = registry.get("ar")
    contenders = {name: MethodContender("ar", ar, ar.make_config(), runner, eos)
                  for name, runner in runners.items()}
    if hf_model is not None:
        contenders["transformers generate"] = HFGenerate(hf_model, eos, prompt_lookup=False)
    if gguf_path is not None and llama_cpp_available() and LLAMA_CPP_PYTHON not in failed:
        need = max(map(len, prompts)) + max_new_tokens + 32
        try:
            contenders["llama.cpp"] = IsolatedLlamaCpp(gguf_path, eos, False, -(-need // 256) * 256)
        except PeerFailed as exc:
            failed["llama.cpp"] = str(exc)
    return contenders


def _ar_end_to_end(contenders: dict, prompts: list[list[int]], max_new_tokens: int,
                   failed: dict[str, str], progress) -> tuple[dict, dict]:
    """Greedy decoding of every prompt by every contender, interleaved prompt by prompt after
    one warm-up each; a peer that fails is dropped (named in ``failed``)."""
    from specdecode.bench.peer_process import PeerFailed

    greedy = SamplingParams()
    live = dict(contenders)
    for name, contender in contenders.items():  # warm-up
        try:
            contender.run(prompts[0], 8, greedy)
        except PeerFailed as exc:
            failed[name] = f"{exc} (in the warm-up)"
            del live[name]
    # new tokens, wall time, prefill time (None where a contender does not report it)
    totals: dict[str, list] = {name: [0, 0.0, 0.0] for name in live}
    answers: dict[str, list[list[int]]] = {name: [] for name in live}
    try:
        for i, prompt in enumerate(prompts):
            for name, contender in list(live.items()):
                try:
                    outcome = contender.run(prompt, max_new_tokens, greedy)
                except PeerFailed as exc:
                    failed[name] = f"{exc} (after {i} prompts)"
                    del live[name], totals[name], answers[name]
                    continue
                totals[name][0] += len(outcome.tokens)
                totals[name][1] += outcome.wall_s
                if totals[name][2] is not None and outcome.prefill_s is not None:
                    totals[name][2] += outcome.prefill_s
                else:
                    totals[name][2] = None
                answers[name].append(outcome.tokens)
            progress(f"ar prompt {i + 1}/{len(prompts)}")
    finally:
        for contender in contenders.values():
            if hasattr(contender, "close"):
                contender.close()
    return answers, totals


def gguf_streamed_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors that llama.cpp reads for one token: all of them but the
    token embedding, of which it reads one row (unless the file has no ``output.weight``: then
    the embedding is the LM head too), and of a mixture-of-experts layer's stacked experts
    (``*_exps``) the share a token picks (expert_used_count of expert_count)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    used, count = (reader.fields.get(f"{arch}.{key}") for key in ("expert_used_count", "expert_count"))
    share = used.contents() / count.contents() if used and count else 1.0
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return int(sum(int(t.n_bytes) * (share if "_exps." in t.name else 1.0)
                   for t in reader.tensors if tied or t.name != "token_embd.weight"))


def runners_markdown(result: dict, meta: dict) -> str:
    lines = ["# specdecode bench --runners", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += _latency_lines(result) + _prompt_and_head_lines(result) + _memory_lines(result)
    if result.get("llama_bench_command"):
        lines += ["", f"llama-bench: `{result['llama_bench_command']}` (its pp rows ask for the "
                      "last row's logits only)."]
    for name, reason in (result.get("peers_failed") or {}).items():
        lines += ["", f"**{reason}**"]
    lines += _ar_lines(result)
    roofline = result.get("roofline")
    if roofline and "native int4" in result["forward_ms"]:
        lines += roofline_markdown(roofline, result["forward_ms"]["native int4"], result["sizes"])
    return "\n".join(lines) + "\n"


def _latency_lines(result: dict) -> list[str]:
    sizes = result["sizes"]
    lines = ["", f"## Per-forward latency (ms, median of {TIMED_FORWARDS}; after a "
                 f"{result['context_tokens']}-token context)", "",
             "| runner | " + " | ".join(f"{s} token{'s' if s > 1 else ''}" for s in sizes)
             + f" | {sizes[-2]} / 1 |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    for name, row in result["forward_ms"].items():
        cells = [f"{row[str(s)]:.1f}" for s in sizes]
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {row[str(sizes[-2])] / row['1']:.2f}x |")
    return lines


def _prompt_and_head_lines(result: dict) -> list[str]:
    """Prompt processing, and the LM head's part of each forward size."""
    prompt_ms, heads = result.get("prompt_ms") or {}, result.get("head_ms") or {}
    if not prompt_ms:
        return []
    sizes, tokens = result["sizes"], result["prompt_tokens"]
    lines = ["", f"## Prompt processing ({tokens} tokens from an empty cache, median of "
                 f"{PROMPT_RUNS}) and the LM head (ms, median of {TIMED_FORWARDS})", "",
             "| runner | prompt (ms) | prompt tokens/s | " + " | ".join(f"head, {s} rows" for s in sizes)
             + f" | head share of {sizes[-2]} rows |", "|---|" + "---:|" * (len(sizes) + 3)]
    for name, ms in prompt_ms.items():
        head = heads.get(name)
        cells = ([f"{head[str(s)]:.1f}" for s in sizes]
                 + [f"{head[str(sizes[-2])] / result['forward_ms'][name][str(sizes[-2])]:.0%}"]
                 if head else ["-"] * (len(sizes) + 1))
        lines.append(f"| {name} | {ms:.0f} | {tokens / ms * 1000:.0f} | " + " | ".join(cells) + " |")
    return lines


def _memory_lines(result: dict) -> list[str]:
    memory = result.get("memory")
    if not memory:
        return []
    gbs = memory["stream_gbs"]
    lines = ["", f"## One row against its memory bound (read bandwidth {gbs:.1f} GB/s, "
                 "measured in this run)", "",
             "| runner | weights streamed per token (MB) | bound (ms) | 1 token (ms) "
             "| 1 token / bound |", "|---|---:|---:|---:|---:|"]
    for name, row in result["forward_ms"].items():
        size = memory["bytes"].get(name)
        if size:
            bound = size / (gbs * 1e9) * 1000
            lines.append(f"| {name} | {size / 1e6:.0f} | {bound:.2f} | {row['1']:.2f} "
                         f"| {row['1'] / bound:.2f}x |")
    return lines


def _ar_lines(result: dict) -> list[str]:
    hf = result["ar"].get("transformers generate", {}).get("tokens_per_s")
    lines = ["", f"## Greedy `ar` end to end ({result['prompts']} first turns, "
                 f"{result['max_new_tokens']} new tokens at most)", "",
             "| decoder | tokens/s | vs transformers generate | tokens/s after the prefill "
             "| answers identical to native fp32 |",
             "|---|---:|---:|---:|---:|"]
    for name, row in result["ar"].items():
        same = row["identical_to_native_fp32"]
        same_cell = "" if same is None else f"{same}/{result['prompts']}"
        if row["new_tokens"] is None:  # llama-bench tg: its own random tokens, not the prompts
            same_cell = "(tg at the same depth, random tokens)"
        ratio = f"{row['tokens_per_s'] / hf:.2f}x" if hf and row["tokens_per_s"] else ""
        lines.append(f"| {name} | {fmt(row['tokens_per_s'], '.1f')} | {ratio} "
                     f"| {fmt(row.get('decode_tokens_per_s'), '.1f')} | {same_cell} |")
    return lines
