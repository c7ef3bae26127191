"""What does one verify step cost at the real vocabulary (49152 tokens) on an 80-node tree?

Real next-token logits come from SmolLM2-135M-Instruct (the default model) along its own greedy
answer to one prompt. For each of ~35 positions the tree is that answer's next 8 tokens (so the
sampled walk often goes deep) plus 72 distractor nodes hanging off it; each row gets the logits
of its own context where the path follows the answer, and those of a random position elsewhere.
Timed: ``verify()`` alone (the target forward is not included), per sampling setting, and the
dense ``target_probs`` over all 81 rows for comparison (what a verifier that processes every
row would pay).

    python scripts/bench_verify.py              # 1 thread
    python scripts/bench_verify.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.draft import Draft
from specdecode.models.loading import load_model
from specdecode.sampling import SamplingParams, target_probs
from specdecode.verify import verify

SETTINGS = {
    "greedy": SamplingParams(),
    "T=0.7": SamplingParams(temperature=0.7),
    "T=0.7 top_p=0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T=0.7 top_k=50 top_p=0.95 min_p=0.05": SamplingParams(temperature=0.7, top_k=50, top_p=0.95,
                                                           min_p=0.05),
    "T=0.7 top_p=0.95 + all penalties": SamplingParams(temperature=0.7, top_p=0.95,
                                                       repetition_penalty=1.1,
                                                       frequency_penalty=0.5,
                                                       presence_penalty=0.3),
}


def cases(nodes: int = 80, depth: int = 8):
    loaded = load_model()
    tok = loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a "
                                    "robot who learns to paint, in three paragraphs."}],
                                  add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    prompt_len = len(ids)
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                    max_new_tokens=120, do_sample=False)[0]
        logits = loaded.model(out[None]).logits[0].float()  # [T, V]
    ids = out.tolist()
    gen = torch.Generator().manual_seed(0)
    vocab = logits.shape[-1]
    built = []
    for t in range(prompt_len + 5, len(ids) - depth - 4, 3):
        truth = ids[t + 1:t + 1 + depth]
        distractors = torch.randint(0, vocab, (24,), generator=gen).tolist()
        paths = [truth] + [truth[:k % depth] + [distractors[k]] * 3 for k in range(24)]
        draft = Draft.from_paths(paths).truncated(64, nodes)
        rows = [logits[t]]
        for i in range(len(draft)):
            path = draft.path_to(i)
            on_truth = all(draft.tokens[n] == truth[j] for j, n in enumerate(path))
            other = int(torch.randint(prompt_len, len(ids), (1,), generator=gen))
            rows.append(logits[t + len(path)] if on_truth else logits[other])
        built.append((draft, torch.stack(rows), ids[:t + 1], prompt_len))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = cases()
    print(f"{len(data)} trees of {len(data[0][0])} nodes, vocabulary {data[0][1].shape[-1]}, "
          f"{args.threads} thread(s)")
    print("| setting | verify (ms) | tokens per step | dense target_probs, 81 rows (ms) |")
    print("|---|---|---|---|")
    for name, params in SETTINGS.items():
        gen = torch.Generator().manual_seed(1)
        verify(*data[0][:2], params, data[0][2], data[0][3], gen)  # warm-up
        committed = 0
        start = time.perf_counter()
        for draft, logits, context, prompt_len in data:
            committed += len(verify(draft, logits, params, context, prompt_len, gen).tokens)
        per_step = (time.perf_counter() - start) / len(data) * 1e3
        dense = "-"
        if not params.greedy:
            draft, logits, context, prompt_len = data[0]
            start = time.perf_counter()
            target_probs(logits, params, context, prompt_len, draft)
            dense = f"{(time.perf_counter() - start) * 1e3:.1f}"
        print(f"| {name} | {per_step:.2f} | {committed / len(data):.2f} | {dense} |")


if __name__ == "__main__":
    main()
