"""``summary.json`` -> ``report.md`` (per task and overall tables) and PNG plots
(``speedup.png``: speedup over ``ar`` per task per contender; ``accepted_hist.png``: the
accepted-length histogram per method). matplotlib (a base dependency) is imported only here.
"""

from __future__ import annotations

from pathlib import Path


def fmt(value, spec: str, suffix: str = "") -> str:
    if isinstance(value, (list, tuple)):  # an interval
        return f"{value[0]:.2f}-{value[1]:.2f}x"
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _table(summary: dict, field: str, spec: str, suffix: str = "") -> list[str]:
    tasks = summary["tasks"]
    lines = ["| method | " + " | ".join(tasks) + " | overall |",
             "|---|" + "---:|" * (len(tasks) + 1)]
    for name, entry in summary["methods"].items():
        cells = [fmt(entry["tasks"].get(t, {}).get(field), spec, suffix) for t in tasks]
        cells.append(fmt(entry["overall"].get(field), spec, suffix))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def markdown(summary: dict, meta: dict) -> str:
    lines = ["# specdecode bench", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += ["", "## Overall", "",
              "| method | kind | tokens/s | speedup vs ar | 95% interval | speedup vs hf | "
              "mean accepted | identical to ar |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, entry in summary["methods"].items():
        o = entry["overall"]
        lines.append(
            f"| {name} | {entry['kind']} | {fmt(o['tokens_per_s'], '.1f')} | "
            f"{fmt(o['speedup_vs_ar'], '.2f', 'x')} | "
            f"{fmt(o.get('speedup_vs_ar_interval'), '')} | "
            f"{fmt(o['speedup_vs_hf'], '.2f', 'x')} | "
            f"{fmt(o['mean_accepted'], '.2f')} | {fmt(o['identical_fraction'], '.0%')} |")
    lines += _prompt_table(summary)
    sections = [("Speedup over ar", "speedup_vs_ar", ".2f", "x"),
                ("Speedup over ar after the prompt (the decoding alone)", "decode_speedup_vs_ar",
                 ".2f", "x"),
                ("Time to first token (the median request's prompt, s)",
                 "time_to_first_token_s", ".3f", ""),
                ("Speedup over transformers generate (hf)", "speedup_vs_hf", ".2f", "x"),
                ("Tokens per second", "tokens_per_s", ".1f", ""),
                ("Mean accepted length (tokens per verify step)", "mean_accepted", ".2f", ""),
                ("Identical to ar (share of question turns)", "identical_fraction", ".0%", "")]
    for title, field, spec, suffix in sections:
        if all(entry["overall"].get(field) is None for entry in summary["methods"].values()):
            continue  # (no contender timed it: runs without peers' or prompts' figures)
        lines += ["", f"## {title}, per task", ""] + _table(summary, field, spec, suffix)
        if field == "speedup_vs_ar" and any(
                cell.get("speedup_vs_ar_interval") for entry in summary["methods"].values()
                for cell in entry["tasks"].values()):
            lines += ["", "95% intervals of the speedup over ar (a bootstrap over each task's "
                          "prompts, from 5 prompts on):", ""]
            lines += _table(summary, "speedup_vs_ar_interval", "", "")
    lines += ["", "Speedups are ratios of pooled throughput (total new tokens / total wall "
                  "time) measured in this run; the 95% interval is a bootstrap over the "
                  "prompts (at least 5), not over runs; see docs/bench.md."]
    if meta.get("sampling") != "greedy":
        lines += ["", "Sampled run: every request is seeded alike, so methods with deterministic "
                      "drafts reproduce ar's tokens; methods that sample drafts, and the peers "
                      "(their own random generators), keep the target's distribution, not ar's "
                      "random stream, so their identical share is not expected to be 100%."]
    if "lossy" in summary:
        lines += lossy_markdown(summary["lossy"])
    lines.append("")
    return "\n".join(lines)


def _prompt_table(summary: dict) -> list[str]:
    """The overall prompt figures (bench/metrics.py), where a contender timed its prompts."""
    timed = {name: entry["overall"] for name, entry in summary["methods"].items()
             if entry["overall"].get("prompt_tokens_per_s") is not None}
    if not timed:
        return []
    lines = ["", "## The prompt and the decoding after it", "",
             "| method | prompt tokens/s | time to first token (median, s) | prompt share of "
             "the time | tokens/s after the prompt | speedup vs ar after the prompt |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, o in timed.items():
        lines.append(f"| {name} | {fmt(o['prompt_tokens_per_s'], '.0f')} | "
                     f"{fmt(o['time_to_first_token_s'], '.3f')} | "
                     f"{fmt(o['prefill_share'], '.0%')} | "
                     f"{fmt(o['decode_tokens_per_s'], '.1f')} | "
                     f"{fmt(o['decode_speedup_vs_ar'], '.2f', 'x')} |")
    return lines


def lossy_markdown(lossy: dict) -> list[str]:
    lines = ["", "## Lossy methods (output differs from ar on purpose; docs/lossy.md)", "",
             "Beside ar and the best exact method of this run. Agreement: tokens = positions "
             "equal to ar's over the longer answer; answers = question turns identical to "
             "ar's. Maths: last number against the reference answer; ROUGE-L: summaries "
             "against ar's.", "",
             "| method | kind | tokens/s | speedup vs ar | token agreement | answer agreement "
             "| maths accuracy | ROUGE-L vs ar |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, q in lossy["methods"].items():
        maths = "-" if q["math_accuracy"] is None else \
            f"{q['math_accuracy']:.0%} of {q['math_questions']}"
        lines.append(f"| {name} | {q['kind']} | {fmt(q['tokens_per_s'], '.1f')} | "
                     f"{fmt(q['speedup_vs_ar'], '.2f', 'x')} | {q['token_agreement']:.1%} | "
                     f"{q['answer_agreement']:.0%} | {maths} | {fmt(q['rouge_l_vs_ar'], '.3f')} |")
    return lines


def plots(summary: dict, histograms: dict[str, dict[int, int]], out: Path) -> list[Path] | str:
    """Write the PNG plots; returns their paths, or why there are none."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or run scripts/setup.sh); no plots"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    scopes = summary["tasks"] + ["overall"]
    names = [n for n in summary["methods"] if n != "ar"]
    if names:
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(scopes)), 4))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            entry = summary["methods"][name]
            values = [(entry["overall"] if s == "overall" else entry["tasks"].get(s, {}))
                      .get("speedup_vs_ar") or 0.0 for s in scopes]
            ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(scopes))], values,
                   width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(scopes)), scopes, rotation=20)
        ax.set_ylabel("speedup over ar")
        ax.legend(fontsize="small", ncol=2)
        fig.tight_layout()
        fig.savefig(out / "speedup.png", dpi=120)
        plt.close(fig)
        written.append(out / "speedup.png")
    shown = {m: h for m, h in histograms.items() if m != "ar" and h}
    if shown:
        fig, axes = plt.subplots(len(shown), 1, figsize=(6, 1.8 * len(shown) + 0.6), squeeze=False)
        for ax, (name, hist) in zip(axes[:, 0], shown.items()):
            steps = sum(hist.values())
            ax.bar(list(hist), [v / steps for v in hist.values()], width=0.8)
            ax.set_title(f"{name} ({steps} verify steps)", fontsize="small")
            ax.set_ylabel("share")
        axes[-1, 0].set_xlabel("tokens committed per verify step (accepted + 1)")
        fig.tight_layout()
        fig.savefig(out / "accepted_hist.png", dpi=120)
        plt.close(fig)
        written.append(out / "accepted_hist.png")
    return written
