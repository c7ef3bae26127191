"""CLI behaviour without a model: bad input is one line on stderr and exit code 2, before any
model loads."""

from __future__ import annotations

import pytest

from specdecode.cli import main


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--method", "nope"], "unknown method 'nope'; known methods: ar"),
    (["generate", "  "], "the prompt is empty"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["generate", "hi", "--method", "ngram", "-c", "bogus=1"], "has no config field 'bogus'"),
    (["generate", "hi", "--method", "ngram", "-c", "max_ngram=0"], "max_ngram (0) must be >="),
    (["generate", "hi", "--method", "ngram", "-c", "max_ngram=x"], "must be int"),
    (["generate", "hi", "-c", "novalue"], "--config expects KEY=VALUE"),
    (["train", "heads", "--kind", "clover", "--pack", "4"],
     "--pack packs conversations for hydra, eagle, deer only; leave it out for clover"),
    (["train", "heads", "--kind", "eagle", "--pack", "0"], "--pack must be >= 1, got 0"),
    (["train", "heads", "--kind", "hydra", "--feature-cache", "-1"],
     "--feature-cache must be >= 0 gigabytes, got -1.0"),
    (["train", "data", "--out", "x.jsonl", "--features", "medusa"],
     "--features: unknown kind 'medusa'; choose from"),
    (["train", "corpus", "--data", "/nonexistent/shard.jsonl", "--out", "c.safetensors"],
     "shard /nonexistent/shard.jsonl does not exist; write one with `specdecode train data"),
    (["train", "corpus", "--data", "x.jsonl", "--out", "c.safetensors", "--max-tokens", "-1"],
     "--max-tokens must be at least 0"),
    (["generate", "hi", "--method", "suffix", "-c", "corpus=/nonexistent.safetensors"],
     "suffix corpus /nonexistent.safetensors does not exist"),
    (["generate", "hi", "--diffusion", "freedave", "--prompt-cache-file", "rows.safetensors"],
     "--diffusion keeps no prompt rows; drop --prompt-cache-file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_methods_lists_every_registered_method(capsys):
    from specdecode import registry

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in registry.names():
        assert f"\n{name}" in "\n" + out
    assert "paper:" in out and "max_tree_depth = 64" in out


def _subparsers(parser):
    """(name, parser) of every subcommand of ``parser``, nested ones too."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield name, child
                yield from ((f"{name} {inner}", grandchild) for inner, grandchild in _subparsers(child))


def test_every_command_has_a_help_page():
    """``--help`` of every command and subcommand renders (a stray % in a help string made
    argparse raise a TypeError for `train data --help`)."""
    from specdecode.cli import EXTERNAL_COMMANDS, build_parser

    seen = set()
    for command in [None, *EXTERNAL_COMMANDS]:
        for name, parser in _subparsers(build_parser(command)):
            text = parser.format_help()
            assert "usage:" in text, name
            seen.add(name)
    assert {"generate", "bench", "serve", "train data", "train heads"} <= seen, sorted(seen)


def test_chat_keeps_the_conversation_and_reads_only_each_new_turn(capsys, monkeypatch):
    """Each turn's prompt is the conversation so far: its earlier turns' rows are kept, a turn
    reads only its own message; /reset starts over, /exit ends before the input does."""
    import io
    import re

    turns = "Say hi.\nAgain, louder.\n/reset\nSay hi.\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    assert main(["chat", "--method", "ar", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    stats = [line for line in err.splitlines() if line.startswith("[ar]")]
    assert len(stats) == 3
    read, kept = ([int(re.search(rf"(\d+) {word}", line).group(1)) for line in stats]
                  for word in ("tokens read", "kept"))
    assert kept[0] == 0 and kept[1] >= read[0]  # the whole first prompt kept
    assert kept[2] == read[0] - 1 and read[2] == 1  # the same first prompt again: all but its last
    answers = out.splitlines()
    assert len(answers) == 3 and answers[0] == answers[2]
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    assert main(["chat", "--method", "ar", "--max-new-tokens", "6", "--no-reuse"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == answers and err.count(" 0 kept") == 3


def test_chat_drops_its_oldest_turns_to_fit_the_context(capsys, monkeypatch):
    """A conversation that outgrows the context drops its oldest turns; a message that does not
    fit alone is refused, and the conversation goes on."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\n" * 6 + "word " * 200 + "\nBye.\n"))
    assert main(["chat", "--method", "ar", "--max-new-tokens", "4", "--max-context", "96"]) == 0
    err = capsys.readouterr().err
    assert "[the oldest turn dropped to fit the context]" in err
    assert err.count("[ar]") == 7 and err.count("specdecode: error:") == 1


def test_ctrl_c_ends_an_answer_not_the_conversation(capsys, monkeypatch):
    """An interrupted answer keeps what it said, and the next turn still reads only its own
    message."""
    import io

    from specdecode.api import TextStream

    feed, calls = TextStream.feed, []

    def interrupted(stream):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return feed(stream)

    monkeypatch.setattr(TextStream, "feed", interrupted)
    monkeypatch.setattr("sys.stdin", io.StringIO("Count to twenty.\nAgain.\n"))
    assert main(["chat", "--method", "ar", "--max-new-tokens", "12"]) == 0
    err = capsys.readouterr().err
    stats = [line for line in err.splitlines() if line.startswith("[ar]")]
    assert "\n[interrupted]\n" in "\n" + err and len(stats) == 2
    assert int(stats[0].split()[1]) < 12 and " 0 kept" not in stats[1]


def test_generate_reads_a_prompt_of_dash_from_standard_input(capsys, monkeypatch):
    import io
    import json

    argv = ["--method", "ar", "--max-new-tokens", "3", "--json"]
    assert main(["generate", "Say hi in French."] + argv) == 0
    given = json.loads(capsys.readouterr().out)["token_ids"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi in French.\n"))
    assert main(["generate", "-"] + argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == given
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert main(["generate", "-"] + argv) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_chat_messages_go_on_past_a_backslash_and_between_triple_quotes(monkeypatch):
    """Pasted code is one message: the lines between two lines of three double quotes; a line
    ending in a backslash goes on to the next."""
    import io

    from specdecode.chat_cli import _messages

    typed = ('Explain:\n"""\ndef f():\n    return 1\n"""\nfirst \\\n  second\n'
             '  /reset \n"""\nno end')
    monkeypatch.setattr("sys.stdin", io.StringIO(typed))
    assert list(_messages()) == ["Explain:", "def f():\n    return 1", "first \n  second", "/reset",
                                 "no end"]


def test_generate_json_reports_the_prompts_logprobs(capsys):
    import json

    argv = ["Say hi in French.", "--max-new-tokens", "4", "--json", "--no-chat"]
    assert main(["generate"] + argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate"] + argv + ["--prompt-logprobs", "2"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["token_ids"] == plain["token_ids"] and "prompt_logprobs" not in plain
    first, *rest = scored["prompt_logprobs"]
    assert first is None and len(rest) >= 4
    assert all(e["logprob"] <= 0 and len(e["top"]) == 2 for e in rest)


def test_generate_reads_and_writes_its_prompt_rows_in_a_file(capsys, tmp_path):
    """A second command that asks about the same text reads its rows from the first one's
    file: the same answer as without the file, its prompt all but the question's tokens."""
    import json

    text = "Here is a list of fruits: apple, banana, cherry, damson, elderberry, fig, grape. "
    argv = ["--max-new-tokens", "8", "--json", "--no-chat", "--method", "suffix"]
    cache = ["--prompt-cache-file", str(tmp_path / "rows.safetensors")]
    assert main(["generate", text + "The third one is"] + argv + cache + ["--compare"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stats"]["cached_tokens"] == first["compare"]["ar_cached_tokens"] == 0
    assert main(["generate", text + "The last one is"] + argv + cache + ["--compare"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert main(["generate", text + "The last one is"] + argv) == 0
    assert second["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert second["compare"]["identical"]
    from specdecode.api import encode_prompt
    from specdecode.models.loading import load_model

    tokenizer = load_model().tokenizer
    asked, asked_again = (encode_prompt(tokenizer, text + end, chat=False)
                          for end in ("The third one is", "The last one is"))
    shared = next(i for i, (a, b) in enumerate(zip(asked, asked_again)) if a != b)
    assert second["stats"]["cached_tokens"] == second["compare"]["ar_cached_tokens"] == shared
