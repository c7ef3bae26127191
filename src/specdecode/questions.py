"""Question files in Spec-Bench's format (Xia et al., Findings of ACL 2024, "Unlocking
Efficiency in Large Language Model Inference: A Comprehensive Survey of Speculative Decoding").

One JSON object a line: ``question_id`` (int), ``category`` (str), ``turns`` (list of str). The
eight MT-bench categories form the task ``mt_bench``; every other category is its own task, so
Spec-Bench's file has six tasks. The packaged default is the development half of Spec-Bench
(240 questions, 40 per task; provenance in ``specdecode/data/SOURCES.md``). The bench times
methods on them (its ``--data`` workloads: bench/datasets.py); trainers take prompts from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdecode.errors import SpecDecodeError, require

MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
#: Spec-Bench's report order; tasks outside it follow alphabetically
TASK_ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
DEFAULT_DATA = "spec_bench_dev.jsonl"


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]
    #: reference answers where the file has them (Spec-Bench's maths questions: GSM8K's
    #: worked answers ending "#### N"), for the lossy methods' task scores
    reference: tuple[str, ...] = ()

    @property
    def task(self) -> str:
        return task_of(self.category)


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def task_sort_key(task: str) -> tuple[int, str]:
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task)


def default_data_path() -> Path:
    return Path(str(resources.files("specdecode") / "data" / DEFAULT_DATA))


def load_questions(path: str | Path | None = None) -> list[Question]:
    """Read and check a question file; errors name the file and line."""
    path = Path(path) if path is not None else default_data_path()
    require(path.is_file(), f"question file {path} does not exist; give a JSON-lines file in "
                            "Spec-Bench's format with --data, or leave --data out for the "
                            "packaged Spec-Bench dev half")
    questions: list[Question] = []
    seen: dict[int, int] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecDecodeError(f"{where}: not valid JSON ({exc.msg}); each line must be "
                                      "one JSON object") from None
            require(isinstance(row, dict), f"{where}: expected a JSON object with question_id, "
                                           "category and turns")
            missing = [k for k in ("question_id", "category", "turns") if k not in row]
            require(not missing, f"{where}: missing field(s) {', '.join(missing)}; Spec-Bench "
                                 "records have question_id, category and turns")
            qid, category, turns = row["question_id"], row["category"], row["turns"]
            require(isinstance(qid, (int, str)) and not isinstance(qid, bool),
                    f"{where}: question_id must be an integer or a string, got {qid!r}")
            require(isinstance(category, str) and category.strip() != "",
                    f"{where}: category must be a non-empty string, got {category!r}")
            require(isinstance(turns, list) and len(turns) > 0
                    and all(isinstance(t, str) and t.strip() for t in turns),
                    f"{where}: turns must be a non-empty list of non-empty strings")
            require(qid not in seen, f"{where}: question_id {qid!r} repeats line {seen.get(qid)}")
            seen[qid] = number
            reference = row.get("reference") or ()
            reference = tuple(r for r in reference if isinstance(r, str)) \
                if isinstance(reference, list) else ()
            questions.append(Question(qid, category, tuple(turns), reference))
    require(len(questions) > 0, f"question file {path} has no questions")
    return questions


def sample_per_task(questions: list[Question], per_task: int | None) -> list[Question]:
    """The first ``per_task`` questions of each task in file order (within MT-bench, spread
    round-robin over its categories so a small sample still covers them)."""
    if per_task is None:
        return list(questions)
    require(per_task > 0, f"--per-task must be positive, got {per_task}")
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    chosen: set[int] = set()
    by_task: dict[str, list[list[Question]]] = {}
    for category, qs in by_category.items():
        by_task.setdefault(task_of(category), []).append(qs)
    for queues in by_task.values():
        picked = 0
        depth = 0
        while picked < per_task and any(depth < len(q) for q in queues):
            for queue in queues:
                if depth < len(queue) and picked < per_task:
                    chosen.add(id(queue[depth]))
                    picked += 1
            depth += 1
    return [q for q in questions if id(q) in chosen]


def pick_questions(questions: list[Question], ids: str) -> list[Question]:
    """The questions named by ``ids`` (comma-separated question ids, e.g. "161,401,code-edit-0"),
    in that order: the order decides what a method that learns across requests has seen."""
    by_id = {str(q.question_id): q for q in questions}
    wanted = [i.strip() for i in ids.split(",") if i.strip()]
    require(wanted, "--questions needs at least one question id")
    missing = [i for i in wanted if i not in by_id]
    require(not missing, f"--questions names ids that --data does not hold: {', '.join(missing)} "
                         f"(its ids: {', '.join(list(by_id)[:6])}, ...)")
    require(len(set(wanted)) == len(wanted), f"--questions repeats a question id: {ids!r}")
    return [by_id[i] for i in wanted]
