"""``specdecode simulate``: replay recorded ``ar`` outputs through a model-free proposer and
report its mean accepted length per task, in seconds, with no model (the offline simulator of
ArcticInference's suffix decoding, Oliaro et al., 2024, "SuffixDecoding").

The recording is a bench ``records.jsonl``: its ``ar`` records hold the prompt ids and the
output ids (``specdecode bench --methods ar --peers none`` makes one). For each record, in file
order (so proposers that learn across requests see them as the bench did):

    proposer.start(prompt); context = prompt + [output[0]]      # the prefill's token
    while output not exhausted:
        draft = proposer.propose(context, budget)               # the engine's budget and cap
        walk the draft: descend into the child holding the recorded next token; the step ends
            with the recorded token after the last accepted node (the bonus)
        proposer.observe(feedback without target logits); controller.observe(...)

This reproduces the engine's steps exactly for a deterministic draft (``probs is None``) under
greedy decoding, and under seeded sampling too (a deterministic draft's sampled verification
walks the sampled tokens, which are ``ar``'s). Each step's tokens are checked to rebuild the
recording. The one place a replay can differ: the engine keeps walking a draft past an
end-of-sequence token the target would accept (those tokens are cut from the output); the
recording has nothing there, so the replay ends at the recording's end.

Simulable methods are those whose proposer builds with ``runner=None`` and never reads the
target's logits; ``ngram`` and ``suffix`` are, ``recycling`` (its matrix is the target's top-k)
is not.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from specdecode.questions import task_sort_key
from specdecode.errors import SpecDecodeError, require
from specdecode.proposer import Feedback


class NeedsModel(SpecDecodeError):
    """The method cannot run without the target model."""


def replay(proposer, controller, prompt: Sequence[int], output: Sequence[int],
           max_new_tokens: int) -> list[int]:
    """Accepted lengths (tokens per verify step) of one recorded request."""
    out = list(output)
    proposer.start(list(prompt))
    context = list(prompt) + out[:1]
    replayed = out[:1]
    lengths: list[int] = []
    while len(context) - len(prompt) < len(out):
        produced = len(context) - len(prompt)
        budget = controller.budget().capped(max_new_tokens - produced - 1)
        draft = proposer.propose(context, budget).truncated(budget.max_depth, budget.max_nodes)
        require(draft.probs is None,
                f"method {proposer.method_name!r} drafts with probabilities; the simulator "
                "replays deterministic drafts only")
        accepted: list[int] = []
        tokens: list[int] = []
        node = -1
        while produced + len(tokens) < len(out):
            token = out[produced + len(tokens)]
            child = next((c for c in draft.children(node) if draft.tokens[c] == token), None)
            if child is None:
                tokens.append(token)  # the bonus / recovered token
                break
            accepted.append(child)
            tokens.append(draft.tokens[child])
            node = child
        replayed.extend(tokens)
        lengths.append(len(tokens))
        proposer.observe(Feedback(tuple(context), draft, None, tuple(accepted), tuple(tokens)))
        controller.observe(len(draft), len(accepted))
        context.extend(tokens)
    require(replayed == out, "the replay does not rebuild the recording")
    proposer.finish(out)
    return lengths


def make_proposer(method, config):
    try:
        return method.proposer(config, None)
    except (AttributeError, TypeError) as exc:
        raise NeedsModel(f"method {method.name!r} needs the target model to build its proposer "
                         f"({exc})") from None


def simulate(records: Sequence[dict], method, config) -> list[list[int]]:
    """Accepted lengths per record for one method (a fresh proposer, records in order)."""
    proposer = make_proposer(method, config)
    controller = proposer.make_controller()
    out = []
    for r in records:
        try:
            out.append(replay(proposer, controller, r["prompt_ids"], r["token_ids"],
                              r["max_new_tokens"]))
        except (AttributeError, TypeError) as exc:
            raise NeedsModel(f"method {method.name!r} needs the target model (its proposer "
                             f"failed without one: {type(exc).__name__}: {exc})") from None
    return out


def simulable(method) -> bool:
    """Whether ``method`` replays without a model (tried on a short synthetic recording)."""
    probe = [{"prompt_ids": [5, 6, 7, 5, 6], "token_ids": [7, 5, 6, 7, 8, 5, 6, 7],
              "max_new_tokens": 8}]
    try:
        simulate(probe, method, method.make_config())
    except (NeedsModel, SpecDecodeError):
        return False
    return True


def load_recording(path: str | Path) -> list[dict]:
    """The ``ar`` records of a bench ``records.jsonl``, checked; errors name the line."""
    path = Path(path)
    require(path.is_file(), f"recording {path} does not exist; give a records.jsonl written by "
                            "`specdecode bench` (e.g. --methods ar --peers none)")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecDecodeError(f"{path}, line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or row.get("method") != "ar":
                continue
            missing = [k for k in ("prompt_ids", "token_ids", "max_new_tokens", "task")
                       if k not in row]
            require(not missing, f"{path}, line {number}: the ar record lacks "
                                 f"{', '.join(missing)}; record it again with `specdecode bench`")
            records.append(row)
    require(records, f"{path} has no 'ar' records to replay; run `specdecode bench` with ar")
    return records


def summarize(records: Sequence[dict], lengths: Sequence[list[int]]) -> dict:
    """task -> {"mean_accepted", "steps", "records"}, plus "overall"."""
    cells: dict[str, list] = {}
    for r, ls in zip(records, lengths):
        for scope in (r["task"], "overall"):
            cell = cells.setdefault(scope, [0, 0, 0])
            cell[0] += sum(ls)
            cell[1] += len(ls)
            cell[2] += 1
    order = sorted((t for t in cells if t != "overall"), key=task_sort_key) + ["overall"]
    return {t: {"mean_accepted": round(cells[t][0] / cells[t][1], 4) if cells[t][1] else None,
                "steps": cells[t][1], "records": cells[t][2]} for t in order}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", help="records.jsonl from `specdecode bench` (its ar records)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated methods (default: every method that needs no model)")
    parser.add_argument("-c", "--config", action="append", default=[], metavar="METHOD.KEY=VALUE",
                        help="method config field (repeatable), e.g. -c ngram.max_ngram=4")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def run(args: argparse.Namespace) -> int:
    from specdecode import registry
    from specdecode.bench.cli import parse_methods

    if args.methods is None:
        names = [n for n in registry.names(lossy=False) if simulable(registry.get(n))]
        methods = parse_methods(",".join(names), args.config)
    else:
        methods = parse_methods(args.methods, args.config)
    records = load_recording(args.recording)
    results = {}
    for name, method, config in methods:
        start = time.perf_counter()
        lengths = simulate(records, method, config)
        results[name] = {"tasks": summarize(records, lengths),
                         "seconds": round(time.perf_counter() - start, 3)}
    if args.json:
        print(json.dumps(results))
        return 0
    tasks = list(next(iter(results.values()))["tasks"]) if results else []
    print(f"mean accepted length (tokens per verify step), {len(records)} recorded requests")
    print(f"{'method':<14}" + "".join(f"{t:>16}" for t in tasks) + f"{'seconds':>10}")
    for name, res in results.items():
        cells = [res["tasks"][t]["mean_accepted"] for t in tasks]
        print(f"{name:<14}" + "".join(f"{'-' if c is None else f'{c:.3f}':>16}" for c in cells)
              + f"{res['seconds']:>10.2f}")
    return 0
