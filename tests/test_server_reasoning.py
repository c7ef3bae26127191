"""Reasoning apart from the answer (server/reasoning.py): the splitter on hand-written texts
(whole and split at every place), whether a template thinks and opens the block itself, and
requests end to end through the real ``openai`` client on the tiny model under a thinking
template (a regex makes its random weights write a reasoning block): ``reasoning_content``
and ``content`` whole and streamed, and a call written inside the reasoning not made."""

from __future__ import annotations

import pytest

from specdecode.server.reasoning import ReasoningSplitter, Thinking, split_reasoning, thinking_of

from tiny_server import MODEL, build_tokenizer, make_server, openai_client, tiny_served_model

OPENED, WRITTEN = Thinking(opened=True), Thinking(opened=False)


@pytest.mark.parametrize("text, thinking, reasoning, content", [
    # the block's text without the whitespace at its ends; the content without that at its start
    ("<think>\nLet me see.\n</think>\n\nParis.", WRITTEN, "Let me see.", "Paris."),
    ("\nLet me see.\n</think>\n\nParis.", OPENED, "Let me see.", "Paris."),
    # a block only where the answer begins with one: later tags are content
    ("Paris. <think>no</think>", WRITTEN, None, "Paris. <think>no</think>"),
    (" \n", WRITTEN, None, " \n"),
    # cut inside the block: all reasoning
    ("<think>Let me", WRITTEN, "Let me", ""),
    ("a </thin", OPENED, "a </thin", ""),
    # whitespace inside the reasoning stays; an empty block gives empty reasoning
    ("x \n y</think>z", OPENED, "x \n y", "z"),
    ("<think></think>Hi", WRITTEN, "", "Hi"),
])
def test_split_whole_answers(text, thinking, reasoning, content):
    assert split_reasoning(text, thinking) == (reasoning, content)


@pytest.mark.parametrize("text, thinking", [
    ("<think>\nLet me see.\n</think>\n\nParis.", WRITTEN),
    ("  <thinking> about it", WRITTEN),
    ("ab </think </think>  \n c </think>", OPENED),
])
def test_any_split_gives_what_the_whole_answer_gives(text, thinking):
    reasoning, content = split_reasoning(text, thinking)
    expected = (reasoning or "", content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 5):
            splitter = ReasoningSplitter(thinking)
            events = [e for part in (text[:i], text[i:j], text[j:]) for e in splitter.feed(part)]
            events += splitter.finish()
            got = ("".join(t for kind, t in events if kind == "reasoning"),
                   "".join(t for kind, t in events if kind == "content"))
            assert got == expected, (i, j)


#: a Qwen3.5-style template: the generation prompt opens the reasoning block, earlier answers
#: are shown without theirs; tools and calls as Qwen2.5 writes them
ASKING = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ (m.content or '').split('</think>')[-1] }}{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n")
#: (with ``enable_thinking`` false, as Qwen3's, an empty block: the answer is all content)
OPENING_TEMPLATE = ASKING + (
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
#: a Qwen3-style one: the model writes the tag itself
WRITING_TEMPLATE = ASKING + "{% endif %}"


def test_a_template_tells_whether_and_how_the_model_thinks():
    assert thinking_of(build_tokenizer(OPENING_TEMPLATE)) == OPENED
    assert thinking_of(build_tokenizer(WRITING_TEMPLATE)) == WRITTEN
    assert thinking_of(build_tokenizer()) is None


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(OPENING_TEMPLATE)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with make_server(model, tokenizer) as background:
        yield background


#: what the regex makes the tiny model write: reasoning, the block's end, an answer
ANSWER = r"[a-z]{2,6}\n</think>\n\n[a-z]{2,6}"
CALL = {"type": "function", "function": {"name": "get_time"}}


def ask(client, stream: bool, regex: str = ANSWER, max_tokens: int = 48, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=max_tokens,
        stream=stream,
        extra_body={"specdecode": {"regex": regex}, **kwargs.pop("extra_body", {})}, **kwargs)


def test_the_reasoning_goes_apart_from_the_content_whole_and_streamed(client):
    message = ask(client, False).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.isalpha() and message.content.isalpha()
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in ask(client, True):
        delta = chunk.choices[0].delta
        streamed["content"] += delta.content or ""
        streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert streamed == {"reasoning_content": reasoning, "content": message.content}


def test_a_call_written_in_the_reasoning_is_not_made(client):
    regex = r"<tool_call>\n\{\"name\": \"get_time\", \"arguments\": \{\}\}\n</tool_call>" \
            r"\n</think>\n\nok"
    message = ask(client, False, regex, 150, tools=[CALL]).choices[0].message
    assert message.tool_calls is None and message.content == "ok"
    assert message.model_extra["reasoning_content"].startswith("<tool_call>")
    for chunk in ask(client, True, regex, 150, tools=[CALL]):
        assert chunk.choices[0].delta.tool_calls is None


def test_thinking_turned_off_by_the_template_s_variables_gives_content_only(client):
    """Qwen3's ``enable_thinking: false`` (vLLM's and llama-server's ``chat_template_kwargs``)
    writes an empty block into the prompt: the answer is all content."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    choice = ask(client, False, r"[a-z]{2,6}", extra_body=off).choices[0]
    assert choice.message.content.isalpha()
    assert choice.message.model_extra.get("reasoning_content") is None
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in ask(client, True, r"[a-z]{2,6}", extra_body=off))
    assert streamed == choice.message.content
    # left on: the prompt opens the block, and an answer that never closes it is reasoning
    thinking = ask(client, False, r"[a-z]{2,6}").choices[0].message
    assert thinking.model_extra["reasoning_content"].isalpha() and thinking.content == ""
