"""Write an lm-evaluation-harness task that scores text through a server's ``echo`` (no dataset
download): the Spec-Bench dev half's summarisation articles (the text ``specdecode bench
--perplexity`` reads), one document each, as a ``loglikelihood_rolling`` task (word and byte
perplexity, bits per byte, as lm-eval's wikitext task reports them).

    python scripts/lm_eval_task.py --out /tmp/lm-task
    specdecode serve --model qwen2.5-coder-1.5b --port 8000 &
    lm_eval --model local-completions --include_path /tmp/lm-task --tasks specdecode_articles \\
      --model_args \\
      model=qwen2.5-coder-1.5b,base_url=http://127.0.0.1:8000/v1/completions,max_length=512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.perplexity import article_texts
from specdecode.questions import load_questions

TASK = "specdecode_articles"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the task (lm_eval --include_path)")
    parser.add_argument("--data", default=None,
                        help="question file (default: the packaged dev half)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = [{"text": text} for text in article_texts(load_questions(args.data))]
    data = out / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    (out / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data.resolve()}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""", encoding="utf-8")
    print(f"{len(docs)} articles -> {out}/{TASK}.yaml")


if __name__ == "__main__":
    main()
