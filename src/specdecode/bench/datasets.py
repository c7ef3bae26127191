"""The bench's ``--data`` workloads: question files in Spec-Bench's format
(:mod:`specdecode.questions`), the packaged Spec-Bench dev half, and ``code-edit`` (edit
instructions over small Python functions, bench/code_edit.py).
"""

from __future__ import annotations

from specdecode.errors import require
from specdecode.questions import Question, load_questions

#: ``--data`` names of the built-in workloads besides files
SPEC_BENCH, CODE_EDIT = "spec-bench", "code-edit"


def load_workloads(spec: str | None) -> list[Question]:
    """``--data``: comma-separated parts, each a question file, ``spec-bench`` (the packaged
    dev half, the default) or ``code-edit`` (one edit instruction over different small Python
    functions, bench/code_edit.py: answers that repeat their prompt, as an agent's edits do)."""
    questions: list[Question] = []
    for part in (spec or SPEC_BENCH).split(","):
        part = part.strip()
        questions += code_edit_questions() if part == CODE_EDIT else load_questions(
            None if part == SPEC_BENCH else part)
    ids = [q.question_id for q in questions]
    require(len(set(ids)) == len(ids), f"--data {spec!r} repeats question ids; give each "
                                       "question file once")
    return questions


def code_edit_questions() -> list[Question]:
    from specdecode.bench.code_edit import FUNCTIONS, INSTRUCTION

    return [Question(f"code-edit-{i}", "code_edit", (INSTRUCTION.format(code=code),))
            for i, code in enumerate(FUNCTIONS)]
