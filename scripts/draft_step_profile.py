"""Where a learned drafter's time goes, per draft step, against a one-row target forward.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/draft_step_profile.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/draft_step_profile.py --methods hydra,eagle \\
        --prompts 4 --max-new-tokens 64 --rounds 3
    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/draft_step_profile.py \\
        --methods eagle,eagle:draft_weights=int4   # variants as `specdecode bench` takes them

Greedy generations of the first turns of Spec-Bench dev questions (one per task, then more),
``ar`` and each method in turn, ``--rounds`` times over the same prompts in one process (so a
load change moves every method of a round alike: the ratios are taken per round, and the
medians over rounds reported). Each method's drafter is timed where it spends its time by
wrapping its own parts (the wrappers cost about a microsecond a call):

    linears      the drafter network's linear maps (the native kernels' calls: nn.Linear
                 converted by heads/native.py); for ``draft_model`` its decoder layers too
                 (one C++ call: the LayerStack, attention included); for ``eagle``, ``deer``
                 (heads/native_blocks.py) and ``hydra`` (heads/native_hydra.py) the whole
                 network, one C++ call a drafter call
    shortlist    the shortlist LM head scoring the drafted nodes' children
    torch ops    the rest of the network's calls (norms, attention, rope, concatenation,
                 indexing; for ``draft_model`` the runner's embedding, attention plan and norm;
                 for the one-call networks, the Python around their call)
    drafter      the draft cache around the network (features, ancestors, masks)
    tree         the proposer's own work outside the drafter calls: ranking children, the
                 best-first heap, the draft (drafting/tree.py), and reading the verify pass's
                 committed features (``observe``)

Times are this thread's CPU seconds (``--clock cpu``, the default): on a machine shared with
other jobs, wall time mostly measures how long the scheduler kept the process waiting (a
one-row forward of 70 ms at load 13 on 2 cores); CPU time still includes what the other jobs
cost it in caches and memory bandwidth. ``--micro-reps``: the fastest of that many draft steps
of 4 nodes and one-row forwards, after the generations.

A *draft step* is one drafter call (reading the committed features or a batch of tree nodes,
scoring their children; a request's first one, which reads the whole prompt, is reported apart
as "prompt ms"); the per-verify-step figures are printed beside it. The target's
one-row forward is ``ar``'s verify call (the runner's forward and LM head, one row).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import statistics
import time
from collections import defaultdict

import torch

from specdecode.api import Decoder
from specdecode.questions import load_questions, sample_per_task
from specdecode.cli_options import parse_config
from specdecode.models.loading import load_model, make_runner

PARTS = ("linears", "shortlist", "torch ops", "drafter", "tree")
#: the clock every timing reads (--clock): this thread's CPU time by default, which a loaded
#: machine's other processes do not add to (their contention for caches and memory still does)
CLOCKS = [time.thread_time]


class Clock:
    """Seconds and calls per label; ``wrap`` times a callable under a label."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, call, label: str):
        @functools.wraps(call)
        def timed(*args, **kwargs):
            start = CLOCKS[0]()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[label] += CLOCKS[0]() - start
                self.calls[label] += 1
        return timed


class TimedLayer:
    """A callable layer object (an int4/int8 linear, a LayerStack, a drafter's C++ head) timed
    under ``label``, its methods too."""

    def __init__(self, layer, clock: Clock, label: str):
        self._layer, self._clock, self._label = layer, clock, label

    def __call__(self, *args, **kwargs):
        start = CLOCKS[0]()
        try:
            return self._layer(*args, **kwargs)
        finally:
            self._clock.seconds[self._label] += CLOCKS[0]() - start
            self._clock.calls[self._label] += 1

    def __getattr__(self, name):  # LayerStack.forward, EagleHead.ingest, ...: timed too
        method = getattr(self._layer, name)
        return self._clock.wrap(method, self._label) if callable(method) else method


def instrument_heads(proposer, clock: Clock) -> None:
    lm = proposer.lm
    if isinstance(lm.net, torch.nn.Module):
        for module in lm.net.modules():
            if type(module).__name__ in ("KernelLinear", "NativeLinear"):
                module.forward = clock.wrap(module.forward, "linears")
    else:  # heads/native_blocks.py, heads/native_hydra.py: the network one C++ call
        net = lm.net
        for name in ("head", "native", "drafter", "fuse", "memory_kv"):  # eagle's, hydra's,
            if getattr(net, name, None) is not None:                      # deer's, clover's
                setattr(net, name, TimedLayer(getattr(net, name), clock, "linears"))
        for name in ("augment", "regress"):  # clover's two one-layer stacks
            if getattr(net, name, None) is not None:
                stacked = getattr(net, name)
                stacked.stack = TimedLayer(stacked.stack, clock, "linears")
    lm.score = TimedLayer(lm.score, clock, "shortlist")
    lm.net.ingest = clock.wrap(lm.net.ingest, "network")
    lm.net.expand = clock.wrap(lm.net.expand, "network")
    lm.catch_up = clock.wrap(lm.catch_up, "drafter calls")
    lm.feed = clock.wrap(lm.feed, "drafter calls")


def instrument_draft_model(proposer, clock: Clock) -> None:
    lm = proposer.lm
    runner = lm.runner.runner  # NativeDraftLM -> LlamaDrafter -> LlamaRunner
    if runner._stack is not None:
        runner._stack = TimedLayer(runner._stack, clock, "linears")
    else:
        for layer in runner.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                object.__setattr__(layer, name, TimedLayer(getattr(layer, name), clock, "linears"))
    runner.head = TimedLayer(runner.head, clock, "shortlist")
    runner.run_items = clock.wrap(runner.run_items, "network")
    lm.catch_up = clock.wrap(lm.catch_up, "drafter calls")
    lm.feed = clock.wrap(lm.feed, "drafter calls")


def set_prompt_apart(proposer, clock: Clock) -> None:
    """A request's first drafter call reads the whole prompt (a prefill of the drafter): its
    seconds go to ``prompt``, not to the draft steps."""
    lm, start = proposer.lm, proposer.start
    catch_up = lm.catch_up  # already timed
    first = [False]

    def started(prompt):
        first[0] = True
        return start(prompt)

    def reading(context):
        if not first[0]:
            return catch_up(context)
        first[0] = False
        seconds, calls = dict(clock.seconds), dict(clock.calls)
        began = CLOCKS[0]()
        out = catch_up(context)
        spent = CLOCKS[0]() - began
        for label in list(clock.seconds):  # the prompt's seconds out of every part
            clock.seconds[label] = seconds.get(label, 0.0)
            clock.calls[label] = calls.get(label, 0)
        clock.seconds["propose"] -= spent  # the enclosing propose adds them when it returns
        clock.seconds["prompt"] += spent
        clock.calls["prompt"] += 1
        return out
    proposer.start, lm.catch_up = started, reading


def instrument(decoder: Decoder, clock: Clock) -> None:
    proposer = decoder.proposer
    proposer.propose = clock.wrap(proposer.propose, "propose")
    proposer.observe = clock.wrap(proposer.observe, "observe")
    if decoder.method.name == "draft_model":
        instrument_draft_model(proposer, clock)
    elif decoder.method.name != "ar":
        instrument_heads(proposer, clock)
    if decoder.method.name != "ar":
        set_prompt_apart(proposer, clock)
    run_packed = decoder.runner.run_packed

    def timed_run_packed(work):
        verify = type(work[0][1]).__name__ == "VerifyCall"
        start = CLOCKS[0]()
        out = run_packed(work)
        if verify:
            clock.seconds["verify"] += CLOCKS[0]() - start
            clock.calls["verify"] += 1
        return out
    decoder.runner.run_packed = timed_run_packed


def breakdown(clock: Clock) -> dict[str, float]:
    """Seconds per part (PARTS) of a whole run."""
    s = clock.seconds
    calls = s["drafter calls"]
    return {"linears": s["linears"], "shortlist": s["shortlist"],
            "torch ops": s["network"] - s["linears"],
            "drafter": calls - s["network"] - s["shortlist"],
            "tree": s["propose"] - calls + s["observe"]}


def make_decoder(runner, tokenizer, method: str) -> Decoder:
    """``method``: a name, or a variant ``name:key=value:...`` as ``specdecode bench`` takes."""
    name, *pairs = method.split(":")
    return Decoder(runner, tokenizer, name, **parse_config(pairs))


def run_method(runner, tokenizer, method: str, prompts, max_new_tokens: int) -> dict:
    decoder = make_decoder(runner, tokenizer, method)
    clock = Clock()
    instrument(decoder, clock)
    committed = steps = 0
    for prompt in prompts:
        stats = decoder.generate(prompt, max_new_tokens).stats
        steps += len(stats.accepted_lengths)
        committed += sum(stats.accepted_lengths)
    del runner.run_packed  # the instance's timing wrapper: the class's method again
    verify_steps = max(1, clock.calls["verify"])
    draft_calls = max(1, clock.calls["drafter calls"])
    parts = breakdown(clock)
    return {
        "verify_ms": 1e3 * clock.seconds["verify"] / verify_steps,
        "step_ms": {k: 1e3 * v / draft_calls for k, v in parts.items()},
        "per_verify_ms": 1e3 * (clock.seconds["propose"] + clock.seconds["observe"]) / verify_steps,
        "prompt_ms": 1e3 * clock.seconds["prompt"] / max(1, clock.calls["prompt"]),
        "calls_per_verify": clock.calls["drafter calls"] / verify_steps,
        "accepted_per_step": committed / max(1, steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="hydra,eagle,clover,deer,draft_model")
    parser.add_argument("--prompts", type=int, default=4, help="first turns of this many questions")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time this thread's CPU seconds (default) or wall seconds")
    parser.add_argument("--micro-reps", type=int, default=200,
                        help="then the fastest of this many draft steps (0: none)")
    args = parser.parse_args()
    CLOCKS[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    loaded = load_model()
    runner = make_runner(loaded)
    questions = sample_per_task(load_questions(), 1)
    prompts = [q.turns[0] for q in questions][:args.prompts]
    methods = args.methods.split(",")
    print(f"{args.clock} clock, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.rounds} rounds")
    rounds = []
    for r in range(args.rounds):
        base = run_method(runner, loaded.tokenizer, "ar", prompts, args.max_new_tokens)
        row = {"ar": base}
        for method in methods:
            row[method] = run_method(runner, loaded.tokenizer, method, prompts, args.max_new_tokens)
        rounds.append(row)
        print(f"round {r + 1}: one-row forward {base['verify_ms']:.2f} ms, load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    if rounds:
        report(rounds, methods)
    if args.micro_reps:
        micro(runner, loaded.tokenizer, methods, prompts[0], 4, args.micro_reps)


def report(rounds: list[dict], methods: list[str]) -> None:
    med = statistics.median
    forward = med(r["ar"]["verify_ms"] for r in rounds)
    print(f"\none-row target forward (ar's verify call): {forward:.2f} ms (median of rounds)")
    header = ("method", "step ms", "/ fwd", *PARTS, "steps/verify", "ms/verify", "prompt ms",
              "accepted")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for m in methods:
        step = med(sum(r[m]["step_ms"].values()) for r in rounds)
        ratio = med(sum(r[m]["step_ms"].values()) / r["ar"]["verify_ms"] for r in rounds)
        parts = [med(r[m]["step_ms"][p] for r in rounds) for p in PARTS]
        print(f"| {m} | {step:.3f} | {ratio:.1%} | " + " | ".join(f"{p:.3f}" for p in parts)
              + f" | {med(r[m]['calls_per_verify'] for r in rounds):.2f}"
              f" | {med(r[m]['per_verify_ms'] for r in rounds):.2f}"
              f" | {med(r[m]['prompt_ms'] for r in rounds):.1f}"
              f" | {med(r[m]['accepted_per_step'] for r in rounds):.2f} |")


def fastest(call, reps: int) -> float:
    """The fastest of ``reps`` calls in ms (other processes only ever slow a call down)."""
    best = float("inf")
    for _ in range(reps):
        start = CLOCKS[0]()
        call()
        best = min(best, CLOCKS[0]() - start)
    return 1e3 * best


def micro(runner, tokenizer, methods: list[str], prompt: str, nodes: int, reps: int) -> None:
    """The fastest of ``reps`` draft steps (a drafter call reading ``nodes`` children of the
    root, scoring theirs, ranking them) after a generation, against the fastest one-row
    forward: robust to load where the medians above are not."""
    from specdecode.draft import Draft
    from specdecode.drafting import tree

    Decoder(runner, tokenizer, "ar").generate(prompt, 16)
    root = 17

    def one_row():  # forward, keep the row, forget it again
        runner.forward(root, Draft.empty())
        runner.commit([])
        runner.cache.rewind(runner.cache.length - 1)
    forward = fastest(one_row, reps)
    print(f"\nfastest of {reps}: one-row target forward {forward:.3f} ms; a draft step of "
          f"{nodes} nodes (drafter call, then ranking their children):")
    for method in methods:
        decoder = make_decoder(runner, tokenizer, method)
        decoder.generate(prompt, 32)
        lm, session = decoder.proposer.lm, decoder.proposer.session
        tokens, parents = list(range(100, 100 + nodes)), [-1] * nodes

        def step():
            logits, _ = lm.feed(tokens, parents)
            if len(inspect.signature(tree.rank_children).parameters) == 5:
                tree.rank_children(session, logits, [], [[]] * nodes, 8)
            else:  # before children were ranked a drafter call at once
                for row in logits:
                    tree.rank_children(session, row, [], 8)
            lm.prune([])
            net = getattr(lm, "net", None)
            if hasattr(net, "committed"):  # eagle keeps tree rows in its cache until ingest
                net.cache.truncate(net.committed)
        ms = fastest(step, reps)
        print(f"  {method}: {ms:.3f} ms = {ms / forward:.1%} of the forward")


if __name__ == "__main__":
    main()
