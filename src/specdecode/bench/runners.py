"""``specdecode bench --runners``: what each runner and weight format costs, beside the peers.

Two measurements, on the same machine in the same run:

- per-forward latency: the median time of one target forward over 1, 8, 16 and 64 new tokens
  (a root plus a chain draft) after a ``--context``-token prefill of real Spec-Bench text, for
  the ``hf`` runner and the native runner in every weight format, and for llama.cpp on the
  GGUF file (``Llama.eval`` of the same tokens with ``logits_all``, since a verify pass needs
  every row's logits);
- end-to-end ``ar`` decoding (greedy, ``--max-new-tokens``) over the first turn of each
  question: tokens/s of every runner, of ``transformers`` ``generate`` and of llama.cpp, and
  how many answers of each native format equal the fp32 native runner's token for token
  (exactness is always against the same runner; this says how far the formats drift);
- the roofline of the native int4 runner: the machine's int8 multiply-add peak (VPDPBUSD
  chains on every thread, nothing else); the ceiling of the Q4 kernel's own instruction mix
  (its VPDPBUSD with the nibble unpacking and the per-group float fold, on registers: the fold
  shares VPDPBUSD's ports); the rate each forward size reaches (the multiply-adds of its linear
  layers over the whole forward's time); and the rate of one layer's linear layers with their
  weights in cache, which separates the kernel from the memory stream and the rest of the
  forward.

Defaults: sizes 1, 8, 16, 64; 9 timed forwards per size after one untimed (median).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from specdecode import kernels
from specdecode.bench.contenders import HFGenerate, LlamaCpp, MethodContender, llama_cpp_available
from specdecode.bench.datasets import Question
from specdecode.bench.runner import encode_messages
from specdecode.draft import Draft
from specdecode.sampling import SamplingParams

FORWARD_SIZES = (1, 8, 16, 64)
TIMED_FORWARDS = 9
#: VPDPBUSD rounds per thread for the peak (12 chains each: about 0.2 s)
PEAK_ITERATIONS = 30_000_000
#: rounds of the Q4 kernel's instruction mix per thread (64 VPDPBUSD each: about 0.2 s)
MIX_ITERATIONS = 5_000_000
#: timed calls of one layer's linear layers with their weights in cache (median)
CACHED_CALLS = 41


def layer_linears(layer) -> list:
    return [layer.qkv, layer.o, layer.gate_up, layer.down]


def row_macs(linear) -> int:
    """Multiply-adds of one row through an int4 linear layer (inputs: 32 per packed group)."""
    return linear.out_features * linear.packed.shape[1] * 32


def linear_macs_per_row(runner) -> int:
    """Multiply-adds of one row through the layers' and the head's linear maps (int4 runner)."""
    linears = [runner.head] + [lin for layer in runner.layers for lin in layer_linears(layer)]
    return sum(map(row_macs, linears))


def cached_layer_gmacs(runner, size: int) -> float:
    """Multiply-adds per second of the first layer's four linear layers on ``size`` rows, called
    again and again so that their weights stay in cache."""
    import torch

    linears = layer_linears(runner.layers[0])
    inputs = [torch.randn(size, lin.packed.shape[1] * 32) for lin in linears]
    macs = size * sum(map(row_macs, linears))
    times = []
    for _ in range(CACHED_CALLS + 1):
        start = time.perf_counter()
        for lin, x in zip(linears, inputs):
            lin(x)
        times.append(time.perf_counter() - start)
    return macs / statistics.median(times[1:]) / 1e9


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


def runner_forward_ms(runner, context: list[int], tokens: list[int], size: int) -> float:
    times = []
    runner.prefill(context)
    for i in range(TIMED_FORWARDS + 1):
        draft = Draft.chain(tokens[1:size]) if size > 1 else Draft.empty()
        start = time.perf_counter()
        runner.forward(tokens[0], draft)
        times.append(time.perf_counter() - start)
        runner.commit([])  # keeps only the root: the context grows by one token per forward
    return statistics.median(times[1:]) * 1000


def llama_cpp_forward_ms(gguf_path: Path, context: list[int], tokens: list[int],
                         sizes: tuple[int, ...]) -> dict[int, float]:
    from llama_cpp import Llama

    from specdecode.bench.contenders import LLAMA_CPP_THREADS

    llm = Llama(model_path=str(gguf_path), n_ctx=len(context) + max(sizes) + 16,
                n_threads=LLAMA_CPP_THREADS, n_threads_batch=LLAMA_CPP_THREADS,
                logits_all=True, verbose=False)
    llm.eval(context)
    result = {}
    for size in sizes:
        times = []
        for _ in range(TIMED_FORWARDS + 1):
            llm.n_tokens = len(context)  # eval drops the KV rows past n_tokens first
            start = time.perf_counter()
            llm.eval(tokens[:size])
            times.append(time.perf_counter() - start)
        result[size] = statistics.median(times[1:]) * 1000
    return result


def measure_runners(loaded, tokenizer, eos, questions: list[Question], gguf_path: Path | None,
                    context: int, max_new_tokens: int, progress=print) -> dict:
    from specdecode import registry
    from specdecode.models.llama import runs
    from specdecode.models.loading import make_runner
    from specdecode.models.quant import WEIGHT_FORMATS

    prompts = first_turns(tokenizer, questions)
    ids = context_ids(prompts, context + max(FORWARD_SIZES))
    ctx, tokens = ids[:context], ids[context:]
    runners = {"hf (fp32)": make_runner(loaded, "hf")}
    if runs(loaded.config):
        runners.update({f"native {fmt}": make_runner(loaded, "native", fmt)
                        for fmt in WEIGHT_FORMATS})
    latency: dict[str, dict[int, float]] = {}
    for name, runner in runners.items():
        latency[name] = {size: runner_forward_ms(runner, ctx, tokens, size)
                         for size in FORWARD_SIZES}
        progress(f"forward latency {name}: {latency[name]}")
    if gguf_path is not None and llama_cpp_available():
        latency["llama.cpp (Q4_1)"] = llama_cpp_forward_ms(gguf_path, ctx, tokens, FORWARD_SIZES)
        progress(f"forward latency llama.cpp: {latency['llama.cpp (Q4_1)']}")

    ar = registry.get("ar")
    roofline = None
    if "native int4" in runners and kernels.isa() == kernels.ISA_LEVELS.index("avx512"):
        int4, ext = runners["native int4"], kernels.load()
        roofline = {"peak_gmacs": ext.int8_peak_macs(PEAK_ITERATIONS) / 1e9,
                    "q4_mix_gmacs": ext.q4_mix_peak_macs(MIX_ITERATIONS) / 1e9,
                    "macs_per_row": linear_macs_per_row(int4),
                    "cached_layer_gmacs": {str(size): cached_layer_gmacs(int4, size)
                                           for size in FORWARD_SIZES}}
    contenders = {name: MethodContender("ar", ar, ar.make_config(), runner, eos)
                  for name, runner in runners.items()}
    contenders["transformers generate"] = HFGenerate(loaded.model, eos, prompt_lookup=False)
    if gguf_path is not None and llama_cpp_available():
        need = max(map(len, prompts)) + max_new_tokens + 32
        contenders["llama.cpp"] = LlamaCpp(gguf_path, eos, False, -(-need // 256) * 256)
    greedy = SamplingParams()
    for contender in contenders.values():  # warm-up
        contender.run(prompts[0], 8, greedy)
    totals = {name: [0, 0.0] for name in contenders}
    answers: dict[str, list[list[int]]] = {name: [] for name in contenders}
    for i, prompt in enumerate(prompts):  # interleaved, prompt by prompt
        for name, contender in contenders.items():
            outcome = contender.run(prompt, max_new_tokens, greedy)
            totals[name][0] += len(outcome.tokens)
            totals[name][1] += outcome.wall_s
            answers[name].append(outcome.tokens)
        progress(f"ar prompt {i + 1}/{len(prompts)}")
    reference = answers.get("native fp32")
    ar_rows = {}
    for name, (new_tokens, wall) in totals.items():
        same = (sum(a == b for a, b in zip(answers[name], reference))
                if reference is not None and name.startswith("native") else None)
        ar_rows[name] = {"tokens_per_s": new_tokens / wall, "new_tokens": new_tokens,
                         "identical_to_native_fp32": same}
    return {"context_tokens": context, "sizes": list(FORWARD_SIZES),
            "forward_ms": {name: {str(k): v for k, v in row.items()} for name, row in latency.items()},
            "ar": ar_rows, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "roofline": roofline}


def runners_markdown(result: dict, meta: dict) -> str:
    lines = ["# specdecode bench --runners", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    sizes = result["sizes"]
    lines += ["", f"## Per-forward latency (ms, median of {TIMED_FORWARDS}; after a "
                  f"{result['context_tokens']}-token context)", "",
              "| runner | " + " | ".join(f"{s} token{'s' if s > 1 else ''}" for s in sizes)
              + f" | {sizes[-2]} / 1 |",
              "|---|" + "---:|" * (len(sizes) + 1)]
    for name, row in result["forward_ms"].items():
        cells = [f"{row[str(s)]:.1f}" for s in sizes]
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {row[str(sizes[-2])] / row['1']:.2f}x |")
    hf = result["ar"].get("transformers generate", {}).get("tokens_per_s")
    lines += ["", f"## Greedy `ar` end to end ({result['prompts']} first turns, "
                  f"{result['max_new_tokens']} new tokens at most)", "",
              "| decoder | tokens/s | vs transformers generate | answers identical to native fp32 |",
              "|---|---:|---:|---:|"]
    for name, row in result["ar"].items():
        same = row["identical_to_native_fp32"]
        same_cell = "" if same is None else f"{same}/{result['prompts']}"
        ratio = f"{row['tokens_per_s'] / hf:.2f}x" if hf else ""
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {ratio} | {same_cell} |")
    roofline = result.get("roofline")
    if roofline:
        int4 = result["forward_ms"]["native int4"]
        peak = roofline["peak_gmacs"]
        mix, per_row = roofline["q4_mix_gmacs"], roofline["macs_per_row"]
        lines += ["", "## Roofline of native int4", "",
                  f"The machine's int8 multiply-add peak (VPDPBUSD alone, every thread): "
                  f"**{peak:.0f} GMAC/s**. The Q4 kernel's own instruction mix on registers "
                  f"(VPDPBUSD with its nibble unpacking and per-group float fold, no memory): "
                  f"**{mix:.0f} GMAC/s** ({mix / peak:.0%} of the peak), the ceiling of GGUF "
                  f"Q4_1 blocks short of AMX. A row's linear layers are "
                  f"{per_row / 1e6:.1f} M multiply-adds.", "",
                  "| rows | forward ms | linear ms at the peak | linear ms at the Q4 ceiling "
                  "| linear GMAC/s over the forward | share of the peak "
                  "| one layer's linears, weights in cache: GMAC/s | share of the peak |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for size in sizes:
            rate = size * per_row / (int4[str(size)] / 1000) / 1e9
            cached = roofline["cached_layer_gmacs"][str(size)]
            lines.append(f"| {size} | {int4[str(size)]:.1f} | {size * per_row / peak / 1e6:.1f} "
                         f"| {size * per_row / mix / 1e6:.1f} | {rate:.0f} | {rate / peak:.0%} "
                         f"| {cached:.0f} | {cached / peak:.0%} |")
    return "\n".join(lines) + "\n"
