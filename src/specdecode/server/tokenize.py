"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the token ids a request's
prompt becomes, exactly as the chat and completion endpoints encode it (a prompt's length
against the context, the ids ``logit_bias`` names), the text of token ids, and the tokenizer's
special tokens and chat template, which is what lm-evaluation-harness's remote tokenizer reads
(``local-completions`` scores through ``echo`` then needs no tokenizer of its own).

    POST /tokenize   {"prompt": "text", "suffix": "text", "add_special_tokens": true}  or
                     {"messages": [...], "tools": [...], "chat_template_kwargs": {...},
                     "continue_final_message": false}, optional "return_token_strs": true
                  -> {"count": N, "max_model_len": C, "tokens": [...], "token_strs": [...]}
    POST /detokenize {"tokens": [...]}  ->  {"prompt": "text", "content": "text"}
    GET /tokenizer_info -> {"tokenizer_class", "eos_token", "bos_token", "pad_token",
                            "chat_template", "model_max_length"}

and llama-server's forms of the first two, which clients with a llama.cpp backend send:

    POST /tokenize   {"content": "text" or ["text", id, ...], "add_special": false,
                      "with_pieces": false}
                  -> {"tokens": [...]}, with pieces [{"id": N, "piece": "text" or [bytes]}]
    POST /detokenize {"tokens": [...]}  ->  {"content": "text"} (the same answer)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from specdecode.engine import check_ids
from specdecode.errors import SpecDecodeError
from specdecode.server.endpoints import chat_prompt, read_json
from specdecode.server.frontend import Frontend
from specdecode.server.protocol import ApiError, ChatRequest, Strict, parse

#: the fields of a chat request that shape its prompt
CHAT_FIELDS = ("messages", "tools", "chat_template_kwargs", "continue_final_message")


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    #: a fill-in-the-middle completion's text after the cursor (``prompt`` the text before it)
    suffix: str | None = None
    #: a chat's messages, tools and template variables (read as the chat endpoint reads them)
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    #: False: a prompt's text without the BOS (or other tokens) the tokenizer puts around it
    #: (the completion endpoint encodes with them); a chat's messages are the template's alone
    add_special_tokens: bool | None = None
    #: also each token's text
    return_token_strs: bool = False


class LlamaTokenizeRequest(Strict):
    """llama-server's: text, or text and token ids mixed (ids kept as they are)."""

    content: str | list[str | int]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, server: Frontend) -> None:
    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(server, await read_json(request, server.settings.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(server, await read_json(request, server.settings.max_body_bytes))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(server)


async def tokenize(server: Frontend, payload: Any) -> dict[str, Any]:
    if isinstance(payload, dict) and "content" in payload:
        return await tokenize_llama(server, parse(LlamaTokenizeRequest, payload))
    req = parse(TokenizeRequest, payload)
    _need_tokenizer(server)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give 'prompt' (a completion's text) or 'messages' (a chat's), "
                            "one of them", param="prompt")
    if req.messages is None:
        chat_only = [f for f in CHAT_FIELDS if getattr(req, f) not in (None, False)]
        if chat_only:
            raise ApiError(400, f"'{chat_only[0]}' goes with 'messages', not 'prompt'",
                           param=chat_only[0])
        if req.suffix:
            ids = (await run_in_threadpool(server.fill_in, req.prompt, req.suffix))[0]
        else:
            ids = await run_in_threadpool(server.encode, req.prompt, False, None, None,
                                          req.add_special_tokens is not False)
    else:
        if req.suffix is not None:
            raise ApiError(400, "'suffix' goes with 'prompt', not 'messages'", param="suffix")
        if req.add_special_tokens:
            raise ApiError(400, "'add_special_tokens' goes with 'prompt': a chat's tokens are "
                                "its template's", param="add_special_tokens")
        chat = {k: payload[k] for k in CHAT_FIELDS if k in payload}
        ids = await chat_prompt(server, parse(ChatRequest, {"model": "", **chat}))
    strs = None
    if req.return_token_strs:
        strs = await run_in_threadpool(server.token_texts, ids)
    return {"count": len(ids), "max_model_len": server.max_context, "tokens": ids,
            "token_strs": strs}


async def tokenize_llama(server: Frontend, req: LlamaTokenizeRequest) -> dict[str, Any]:
    """llama-server's ``/tokenize``: each text part encoded (the tokenizer's special tokens
    around the first only with ``add_special``), each id kept."""
    _need_tokenizer(server)
    if not req.parse_special:
        raise ApiError(400, "parse_special false (special tokens' text read as plain text) is "
                            "not served; send true", param="parse_special")
    parts = [req.content] if isinstance(req.content, str) else req.content
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, int):
            ids.append(part)
            continue
        ids += await run_in_threadpool(server.encode, part, False, None, None,
                                       req.add_special and i == 0)
    try:
        check_ids(ids, server.runner_info.vocab_size, "token ids")
    except SpecDecodeError as exc:
        raise ApiError(400, str(exc), param="content") from None
    if not req.with_pieces:
        return {"tokens": ids}
    pieces = server.vocabulary.token_bytes
    return {"tokens": [{"id": t, "piece": _piece(pieces[t])} for t in ids]}


def _piece(piece: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (llama-server's form)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


async def detokenize(server: Frontend, payload: Any) -> dict[str, Any]:
    req = parse(DetokenizeRequest, payload)
    _need_tokenizer(server)
    try:
        check_ids(req.tokens, server.runner_info.vocab_size, "token ids")
    except SpecDecodeError as exc:
        raise ApiError(400, str(exc), param="tokens") from None
    text = await run_in_threadpool(server.decode, req.tokens)
    return {"prompt": text, "content": text}  # vLLM's key and llama-server's


def tokenizer_info(server: Frontend) -> dict[str, Any]:
    """The tokenizer's class, special tokens, chat template and the model's context."""
    _need_tokenizer(server)
    tokenizer = server.tokenizer
    return {"tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": server.max_context}


def _need_tokenizer(server: Frontend) -> None:
    if server.tokenizer is None:
        raise ApiError(400, "this server has no tokenizer, so it cannot tokenize")
