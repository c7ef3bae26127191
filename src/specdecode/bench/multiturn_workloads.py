"""The conversations ``scripts/multiturn_bench.py`` sends, each turn with its whole history:

- ``mt-bench``: Spec-Bench dev's MT-bench questions, their two turns;
- ``chat``: a six-turn chat of our own (:data:`CHAT_TURNS`), one topic carried from turn to turn;
- ``agent``: a coding agent with two tools, ``read_file`` and ``write_file``, over a small
  project held in memory (:data:`PROJECT`): each task is sent, then every tool call the model
  makes is carried out and its result sent back, until the model answers in text (at most
  :data:`MAX_TOOL_ROUNDS` requests a task).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specdecode.questions import load_questions

CHAT_TURNS = (
    "I want to write a small command-line tool in Python that counts words in text files. "
    "What should its interface look like?",
    "Good. How would you structure the code into functions?",
    "Write the function that counts the words of one file.",
    "How should it treat punctuation and case? Change the function accordingly.",
    "Now add a main function that takes several files and prints a total.",
    "Finally, write two unit tests for the counting function.",
)

PROJECT = {
    "stats.py": (
        "def mean(values):\n"
        "    total = 0\n"
        "    for v in values:\n"
        "        total += v\n"
        "    return total / len(values)\n\n\n"
        "def spread(values):\n"
        "    return max(values) - min(values)\n"),
    "report.py": (
        "from stats import mean, spread\n\n\n"
        "def report(values):\n"
        "    print('mean', mean(values))\n"
        "    print('spread', spread(values))\n"),
}

AGENT_SYSTEM = ("You are a coding agent working on a small Python project with the files "
                f"{', '.join(sorted(PROJECT))}. Use the tools to read and write files.")

AGENT_TASKS = (
    "Read stats.py and tell me what it does.",
    "Rename the function mean to average in stats.py and write the file back.",
    "Update report.py to use the new name.",
    "Add a docstring to spread in stats.py.",
)

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace the content of a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]

#: requests of one agent task at most (the task, then tool results)
MAX_TOOL_ROUNDS = 3
WORKLOADS = ("mt-bench", "chat", "agent")


@dataclass
class Conversation:
    """One conversation: its name, the user turns (or agent tasks) in order, and for the agent
    the tools and the project's files it reads and writes."""

    workload: str
    name: str
    system: str | None
    turns: tuple[str, ...]
    tools: list[dict] | None = None
    files: dict[str, str] = field(default_factory=dict)

    def run_tool(self, name: str, arguments: str) -> str:
        """The result the agent's tool call gets (an error text for a bad call)."""
        try:
            args = json.loads(arguments)
            path = args["path"]
            if name == "read_file":
                return self.files.get(path, f"error: no file {path}")
            if name == "write_file":
                self.files[path] = args["content"]
                return f"wrote {len(args['content'])} characters to {path}"
        except (ValueError, KeyError, TypeError) as exc:
            return f"error: bad arguments ({exc})"
        return f"error: no tool {name}"


def conversations(workloads: list[str], mt_bench: int) -> list[Conversation]:
    """The conversations of ``workloads``: the first ``mt_bench`` MT-bench questions."""
    out = []
    if "mt-bench" in workloads:
        questions = [q for q in load_questions() if q.task == "mt_bench"][:mt_bench]
        out += [Conversation("mt-bench", f"mt-bench #{q.question_id}", None, tuple(q.turns))
                for q in questions]
    if "chat" in workloads:
        out.append(Conversation("chat", "word counter", None, CHAT_TURNS))
    if "agent" in workloads:
        out.append(Conversation("agent", "rename and document", AGENT_SYSTEM, AGENT_TASKS,
                                TOOLS, dict(PROJECT)))
    return out
