"""What ``scripts/serving_bench.py`` sends: the requests of each workload and their sampling.

Three workloads, each a fixed list of single-turn chat requests (every server applies its own
chat template, as a user's client would leave it to do):

- ``spec-bench``: the first turns of Spec-Bench dev questions (:mod:`.datasets`), taken task
  by task in turn (MT-bench, translation, summarization, QA, math, RAG, MT-bench, ...) so that
  any number of requests mixes short prompts with the long summarization and RAG ones;
- ``code-edit``: :mod:`.code_edit`'s one instruction over different functions;
- ``agent``: coding agents' first requests: the same system prompt (a module of
  :data:`AGENT_FUNCTIONS` of :mod:`.code_edit`'s functions, in full) and the same tools
  (``read_file``, ``write_file``) before a task of each request's own (:func:`agent_task`), as
  agents started together send them: their common start is most of each prompt.

Two samplings: ``greedy`` (temperature 0) and ``seeded`` (temperature 0.7, top-p 1, top-k and
min-p off, request ``i`` seeded ``seed + i``): a seeded request must give the same tokens at any
load, as a greedy one must.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.bench.code_edit import FUNCTIONS, INSTRUCTION
from specdecode.bench.multiturn_workloads import TOOLS
from specdecode.questions import Question, task_sort_key
from specdecode.errors import require

WORKLOADS = ("spec-bench", "code-edit", "agent")
#: functions of the agent workload's module (each request's task names one)
AGENT_FUNCTIONS = 16
#: what an agent request asks of a function of the module, in turn
AGENT_TASKS = (
    "What does {name} in utils.py do? Answer in one sentence.",
    "Add type hints and a docstring to {name} in utils.py, then write the file back.",
    "Write a pytest test for {name} from utils.py.",
    "Does {name} in utils.py fail on some input? Answer briefly.",
)
SAMPLINGS = ("greedy", "seeded")
#: the temperature of the ``seeded`` sampling
SEEDED_TEMPERATURE = 0.7


@dataclass(frozen=True)
class Request:
    """One chat request of a workload; ``index`` is its place in the workload (the same at
    every concurrency, so its answer under load is compared with its answer alone)."""

    index: int
    workload: str
    #: where the prompt comes from (question id and task, or the function's first line)
    source: str
    prompt: str
    #: the system message, where the request has one
    system: str | None = None
    #: OpenAI function definitions the request offers the model
    tools: tuple[dict, ...] = ()

    @property
    def streamed(self) -> bool:
        """Every other request streams, so each batch mixes both kinds of response."""
        return self.index % 2 == 1

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.prompt}]


def interleave_tasks(questions: list[Question]) -> list[Question]:
    """The questions task by task in turn (Spec-Bench's task order), each task in file order."""
    by_task: dict[str, list[Question]] = {}
    for q in questions:
        by_task.setdefault(q.task, []).append(q)
    queues = [by_task[t] for t in sorted(by_task, key=task_sort_key)]
    out: list[Question] = []
    for depth in range(max(len(q) for q in queues)):
        out += [queue[depth] for queue in queues if depth < len(queue)]
    return out


def spec_bench_requests(questions: list[Question], count: int) -> list[Request]:
    require(count <= len(questions),
            f"--requests {count} is more than the {len(questions)} questions of the data file")
    chosen = interleave_tasks(questions)[:count]
    return [Request(i, "spec-bench", f"{q.task} #{q.question_id}", q.turns[0])
            for i, q in enumerate(chosen)]


def code_edit_requests(count: int) -> list[Request]:
    require(count <= len(FUNCTIONS),
            f"--requests {count} is more than the {len(FUNCTIONS)} code-edit functions (each "
            "request edits a different one)")
    return [Request(i, "code-edit", code.splitlines()[0], INSTRUCTION.format(code=code))
            for i, code in enumerate(FUNCTIONS[:count])]


def agent_system() -> str:
    """The agent workload's system prompt: the module its tasks are about, in full."""
    module = "\n\n\n".join(FUNCTIONS[:AGENT_FUNCTIONS])
    return ("You are a coding agent working on a Python project. Its module utils.py holds:\n\n"
            f"```python\n{module}\n```\n\nUse the tools to read and write the project's files.")


def agent_task(index: int) -> tuple[str, str]:
    """Request ``index``'s task and the first line of the function it names: the tasks in
    turn, each over every function once in :data:`AGENT_TASKS` x :data:`AGENT_FUNCTIONS`
    requests."""
    kind = index % len(AGENT_TASKS)
    code = FUNCTIONS[(index // len(AGENT_TASKS) + 5 * kind) % AGENT_FUNCTIONS]
    first = code.splitlines()[0]
    return AGENT_TASKS[kind].format(name=first.split()[1].split("(")[0]), first


def agent_requests(count: int) -> list[Request]:
    most = len(AGENT_TASKS) * AGENT_FUNCTIONS
    require(count <= most, f"--requests {count} is more than the {most} agent tasks")
    system = agent_system()
    return [Request(i, "agent", first, task, system, tuple(TOOLS))
            for i, (task, first) in enumerate(map(agent_task, range(count)))]


def build_workload(name: str, count: int, questions: list[Question] | None = None) -> list[Request]:
    """``count`` requests of workload ``name`` (``questions``: the Spec-Bench file's)."""
    require(name in WORKLOADS, f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    require(count > 0, f"--requests must be positive, got {count}")
    if name == "code-edit":
        return code_edit_requests(count)
    if name == "agent":
        return agent_requests(count)
    require(questions is not None, "the spec-bench workload needs the question file")
    return spec_bench_requests(questions, count)


@dataclass(frozen=True)
class Sampling:
    name: str
    temperature: float
    #: request i gets ``seed + i``; None: greedy, no seed sent
    seed: int | None = None

    def fields(self, index: int) -> dict:
        """The chat-completion fields of request ``index`` (top-k and min-p go in the body:
        the openai client has no arguments for them, and llama-server's defaults are not
        off, 40 and 0.05)."""
        if self.seed is None:
            return {"temperature": 0.0}
        return {"temperature": self.temperature, "top_p": 1.0, "seed": self.seed + index,
                "extra_body": {"top_k": 0, "min_p": 0.0}}


def sampling_of(name: str, seed: int) -> Sampling:
    require(name in SAMPLINGS, f"unknown sampling {name!r}; choose from {', '.join(SAMPLINGS)}")
    return Sampling("greedy", 0.0) if name == "greedy" else \
        Sampling("seeded", SEEDED_TEMPERATURE, seed)
