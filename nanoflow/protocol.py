"""The OpenAI protocol: a body read into token ids and SamplingParams, and the answers' shapes.

`prompt_of`, `constraints` and `sampling_params` (through the engine's door,
`Engine.check_prompt`) raise a ValueError for a client's mistake: serve.py answers it with a
400. `Reply` and `chunks` turn the engine thread's `ChoiceDelta`s into OpenAI's objects. It
imports the engine's types, grammar.py and tools.py; serve.py, api.py and live.py import it.
"""

import itertools
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field, fields, replace
from http import HTTPStatus

from jinja2 import TemplateError

from .anthropic import text_of
from .engine import Engine
from .grammar import response_format_schema
from .request import SamplingParams
from .tools import ToolCallStream, ToolRequest, template_messages

log = logging.getLogger("nanoflow.serve")

MAX_CHOICES = 16  # `n`: copies of one prompt; more would crowd out everyone else's requests
# the SamplingParams fields a body sets by name (OpenAI's, vLLM's); `logprobs` differs per
# endpoint, `json_schema` comes from response_format or tool_choice
SAMPLING_FIELDS = [
    f.name
    for f in fields(SamplingParams)
    if f.name not in ("max_tokens", "logprobs", "json_schema")
]
# OpenAI parameters the engine cannot honour: accepted only when absent, null or this neutral value
UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": "", "functions": [], "function_call": "none"}
# vLLM's and SGLang's, that vLLM's router fills in with these defaults: nanoflow's behaviour (the
# last message not continued, stop strings trimmed, specials skipped, thinking apart and streamed)
UNSUPPORTED |= dict(continue_final_message=False, no_stop_trim=False, return_hidden_states=False)
UNSUPPORTED |= dict(skip_special_tokens=True, separate_reasoning=True, stream_reasoning=True)
UNSUPPORTED |= dict(include_reasoning=True)
# the other fields a body may carry, by what they are about
PROMPT_FIELDS = ("model", "messages", "prompt", "chat_template_kwargs", "user")
OUTPUT_FIELDS = ("stream", "stream_options", "max_tokens", "max_completion_tokens", "n")
LOGPROBS_FIELDS = ("logprobs", "top_logprobs")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
# what a body may carry; any other field is unknown, ignored with a warning (as vLLM does)
KNOWN_FIELDS = {*PROMPT_FIELDS, *OUTPUT_FIELDS, *LOGPROBS_FIELDS, *TOOL_FIELDS}
KNOWN_FIELDS |= {*SAMPLING_FIELDS, *UNSUPPORTED}
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer system


class HTTPError(Exception):
    """An error answered as OpenAI does: a status and {"error": {"message", "type", "code"}}."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.code = code or re.sub("[ -]", "_", HTTPStatus(status).phrase.lower())

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {"error": {"message": str(self), "type": kind, "code": self.code}}


@dataclass
class ChoiceDelta:
    """What the engine thread tells a connection: a choice's new text; at the end, its finish."""

    index: int = 0
    text: str = ""
    logprobs: list = field(default_factory=list)  # per new token: (id, (logprob, top alternatives))
    finish_reason: str | None = None
    completion_tokens: int = 0  # at the end
    error: HTTPError | None = None
    reasoning: str = ""  # with --reasoning-parser: the thinking (`text` is then the answer)
    stop_reason: str | None = None  # at the end: the stop string that ended it, if one did


# ---------------------------------------------------------------- a body's checks: OpenAI to engine


def check_fields(body: dict, request_id: str) -> None:
    """Unsupported OpenAI parameters are a 400; unknown fields are ignored, with a warning."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in (None, neutral):
            advice = f"leave it out or set it to {json.dumps(neutral)}"
            message = f"nanoflow does not support `{name}`; {advice}"
            raise HTTPError(400, message, "unsupported_parameter")
    if unknown := sorted(body.keys() - KNOWN_FIELDS):
        log.warning("%s: ignoring unknown fields %s", request_id, ", ".join(unknown))


def flag(obj: dict, name: str) -> bool:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"`{name}` must be true or false")
    return bool(value)


def chat_messages(body: dict) -> list[dict]:
    """`messages` as [{"role", "content"}] with string content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('`messages` must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        with suppress(ValueError):  # a list of text parts, joined; anything else is refused below
            content = text_of(content, "content")
        # an assistant's calls without text: tools.template_messages adds them
        if content is None and isinstance(m, dict) and m.get("tool_calls"):
            content = ""
        if not (isinstance(content, str) and isinstance(m.get("role"), str)):
            raise ValueError(f"messages[{i}] needs string `role` and `content` (or text parts)")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has role {m['role']!r}; use {', '.join(ROLES)}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def prompt_ids(prompt, tokenizer) -> list[int]:
    """`prompt` as text or token ids; a batch of one is unwrapped (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    raise ValueError("`prompt` must be a string or a list of token ids (one per request)")


def prompt_of(body: dict, tokenizer, chat: bool, tools: ToolRequest | None = None) -> list[int]:
    """Token ids: chat `messages` and tools via the template, or `prompt` (text or ids)."""
    if not chat:
        return prompt_ids(body.get("prompt"), tokenizer)
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions with a prompt")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("`chat_template_kwargs` must be an object")
    messages = chat_messages(body)
    try:
        messages = template_messages(messages, body["messages"], tokenizer.chat_template)
        return tokenizer.apply_chat_template(messages, **{**kwargs, "tools": tools and tools.tools})
    except (ValueError, TemplateError) as e:
        raise ValueError(f"cannot apply the chat template: {e}") from None


def constraints(
    body: dict, template: str | None, chat: bool
) -> tuple[ToolRequest | None, dict | None]:
    """The request's tools and the JSON schema its output must follow (grammar.py, tools.py)."""
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise ValueError("`tools` need /v1/chat/completions")
    tools = ToolRequest.of(body, template) if chat else None
    schema = response_format_schema(body.get("response_format"))
    forced = tools.json_schema() if tools else None
    if forced is not None and schema is not None:
        raise ValueError(
            "`response_format` and a forced `tool_choice` both constrain the output; send one"
        )
    return tools, schema if forced is None else forced


def sampling_params(
    body: dict, ids: list[int], engine: Engine, defaults: dict, chat: bool
) -> list[SamplingParams]:
    """Each choice's SamplingParams, the body's over the defaults, checked by the engine."""
    given = {**defaults, **{k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}}
    asked = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    room = engine.max_model_len - len(ids)
    max_tokens = asked[0] if asked else max(1, room)  # by default, to the context's end (as vLLM)
    params = SamplingParams(max_tokens=max_tokens, logprobs=num_logprobs(body, chat), **given)
    engine.check_prompt(ids, params)
    if params.max_tokens > room:
        context = f"{len(ids)} prompt tokens in a {engine.max_model_len}-token context"
        message = f"{context}: max_tokens can be {room} at most"
        raise HTTPError(400, message, "context_length_exceeded")
    return per_choice_params(body, params)


def num_logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives: chat's `logprobs: true, top_logprobs: k`, completions' `logprobs: k`."""
    if not chat:
        return body.get("logprobs")
    if body.get("top_logprobs") is not None and not flag(body, "logprobs"):
        raise ValueError("`top_logprobs` needs `logprobs: true`")
    return (body.get("top_logprobs") or 0) if flag(body, "logprobs") else None


def per_choice_params(body: dict, params: SamplingParams) -> list[SamplingParams]:
    """`n` copies of the request; seeded, choice i samples with seed + i (so that they differ)."""
    n = 1 if body.get("n") is None else body["n"]
    if not (type(n) is int and 1 <= n <= MAX_CHOICES):
        raise ValueError(f"`n` must be an integer in [1, {MAX_CHOICES}]")
    seeds = [None] * n if params.seed is None else [(params.seed + i) % 2**64 for i in range(n)]
    return [replace(params, seed=seed) for seed in seeds]


# ---------------------------------------------------------------- answers: OpenAI's objects


@dataclass
class Reply:
    """Builds the OpenAI objects of one response: chat.completion(.chunk) or text_completion."""

    id: str
    model: str
    chat: bool
    tokenizer: object
    num_prompt: int
    logprobs: bool  # asked for: each choice has a (maybe empty) list
    include_usage: bool = False
    reasoning: bool = False  # a reasoning parser splits the text: reasoning_content apart
    tools: ToolRequest | None = None
    tool_streams: dict = field(default_factory=dict)  # per choice: its ToolCallStream
    stop_reason: str | None = None  # the stop string that ended the last finished choice
    created: int = field(default_factory=lambda: int(time.time()))
    text_sent: Counter = field(default_factory=Counter)  # per choice: characters with logprobs sent

    def _object(self, choices: list, whole: bool = False, **extra) -> dict:
        chat_kind = "chat.completion" if whole else "chat.completion.chunk"
        if self.include_usage and not whole:  # a chunk's usage is null, but for the last one
            extra.setdefault("usage", None)
        return {
            "id": self.id,
            "object": chat_kind if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _choice(
        self, index: int, finish_reason: str | None = None, logprobs: list | None = None, **content
    ) -> dict:
        if logprobs is None:
            shaped = None
        elif self.chat:
            shaped = chat_logprobs(logprobs, self.tokenizer)
        else:
            # offsets count from the start of the choice's text, across chunks too
            shaped = text_logprobs(logprobs, self.tokenizer, self.text_sent[index])
            self.text_sent[index] += sum(map(len, shaped["tokens"]))
        return {"index": index, **content, "logprobs": shaped, "finish_reason": finish_reason}

    def chunk(self, delta: ChoiceDelta, role: bool = False) -> dict:
        text = {"content": delta.text} if delta.text else {}
        if self.tools and delta.text:
            text = self.tool_stream(delta.index).feed(delta.text)
        if delta.reasoning:
            text["reasoning_content"] = delta.reasoning
        chat_delta = {"role": "assistant", "content": ""} if role else text
        content = {"delta": chat_delta} if self.chat else {"text": delta.text}
        choice = self._choice(delta.index, delta.finish_reason, delta.logprobs or None, **content)
        return self._object([choice])

    def tool_stream(self, index: int) -> ToolCallStream:
        return self.tool_streams.setdefault(index, ToolCallStream(self.tools))

    def finish_chunks(self, delta: ChoiceDelta) -> list[dict]:
        """A choice's last chunks: the text its tool parser held (calls or content), the finish."""
        self.stop_reason = delta.stop_reason
        if not self.tools:
            return [self.chunk(ChoiceDelta(delta.index, finish_reason=delta.finish_reason))]
        parser = self.tool_stream(delta.index)
        held = [self._object([self._choice(delta.index, delta=d)]) for d in parser.finish()]
        reason = parser.finish_reason(delta.finish_reason)
        return held + [self.chunk(ChoiceDelta(delta.index, finish_reason=reason))]

    def _usage(self, deltas: list[ChoiceDelta]) -> dict:
        completion = sum(e.completion_tokens for e in deltas if e.finish_reason)
        return {
            "prompt_tokens": self.num_prompt,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt + completion,
        }

    def whole(self, deltas: list[ChoiceDelta]) -> dict:
        """Each choice from its deltas: text and logprobs joined, the last one's finish reason."""
        out = []
        for i in range(len({e.index for e in deltas})):
            mine = [e for e in deltas if e.index == i]
            text = "".join(e.text for e in mine)
            tokens = [t for e in mine for t in e.logprobs] if self.logprobs else None
            message = {"role": "assistant", "content": text}
            reason = mine[-1].finish_reason
            if self.reasoning:  # as vLLM: null where there is none
                reasoning = "".join(e.reasoning for e in mine)
                message.update(content=text or None, reasoning_content=reasoning or None)
            if self.tools:
                message.update(self.tool_stream(i).message(text))
                reason = self.tool_stream(i).finish_reason(reason)
            content = {"message": message} if self.chat else {"text": text}
            out.append(self._choice(i, reason, tokens, **content))
        return self._object(out, whole=True, usage=self._usage(deltas))


def chat_logprobs(tokens: list, tokenizer) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(*a) for a in top]} for t, (lp, top) in tokens
        ]
    }


def text_logprobs(tokens: list, tokenizer, start: int) -> dict:
    """OpenAI's completions shape: lists of tokens, their logprobs, top alternatives, offsets."""
    texts = [tokenizer.decode([t]) for t, _ in tokens]
    return {
        "tokens": texts,
        "token_logprobs": [lp for _, (lp, _) in tokens],
        "top_logprobs": [{tokenizer.decode([i]): v for i, v in top} for _, (_, top) in tokens],
        "text_offset": list(itertools.accumulate(map(len, texts), initial=start))[:-1],
    }


def chunks(reply: Reply, deltas: Iterator[ChoiceDelta], n: int) -> Iterator[dict]:
    """The deltas as OpenAI's chat.completion.chunks; an error's body ends them."""
    if reply.chat:
        for i in range(n):
            yield reply.chunk(ChoiceDelta(i), role=True)
    done = []
    for delta in deltas:
        if delta.error:
            yield delta.error.body()
            return
        if delta.text or delta.reasoning or delta.logprobs:
            yield reply.chunk(replace(delta, finish_reason=None))
        # the finish in a chunk of its own, as OpenAI sends it
        if delta.finish_reason:
            yield from reply.finish_chunks(delta)
            done.append(delta)
    if reply.include_usage and len(done) == n:
        yield reply._object([], usage=reply._usage(done))


def finished(deltas: Iterator[ChoiceDelta]) -> list[ChoiceDelta]:
    """Every delta of a whole answer; the first error is raised instead."""
    got = list(deltas)
    if errors := [e.error for e in got if e.error]:
        raise errors[0]
    return got
