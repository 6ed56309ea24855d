"""The HTTP front door: an OpenAI-compatible server on the standard library's `http.server`.

A connection thread checks and tokenizes a request; the engine thread alone touches the Engine: it
adds and aborts requests, steps, and puts each one's new text on its queue, which the connection
sends at once (an SSE chunk per token). The server listens before the model loads; `GET /`: live.py.
"""

import argparse
import functools
import hmac
import itertools
import json
import logging
import math
import queue
import re
import select
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, fields, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from jinja2 import TemplateError

from . import anthropic, dist, responses
from .anthropic import text_of
from .engine import LLM, Engine, EngineConfig
from .grammar import response_format_schema
from .live import SNAPSHOT_INTERVAL_S, LiveView, burst_requests, page
from .metrics import Metrics, rebuffer_time
from .reasoning import REASONING_PARSERS, split_reasoning
from .request import Request, SamplingParams
from .tools import ToolCallStream, ToolRequest, template_messages

log = logging.getLogger("nanoflow.serve")

DEMO_MODEL_ID = "SmolLM2-135M-Instruct"  # what /v1/models calls the demo checkpoint
MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt as token ids fits; a larger body is a mistake: 413
DRAIN_LIMIT_BYTES = 64 << 20  # after our 413, what the client still sends is read and dropped...
DRAIN_IDLE_S = 1.0  # ...while it keeps sending (a client that waits for our answer sends nothing)
DEFAULT_MAX_WAITING = 256  # requests without a first token yet; more would only wait longer: 503
START_BOUND_S = 2.0  # ...not counting those the engine will start within this (its prefill rate)
RETRY_AFTER_S = 1  # the least an overloaded server asks a client to wait before it retries
POLL_S = 0.05  # how often a waiting connection checks that its client is still there: ~one step
CLIENT_TIMEOUT_S = 60.0  # a client silent this long (headers, body, an unread stream) is dropped
SHUTDOWN_GRACE_S = 5.0  # how long shutdown waits for aborted streams to write their last chunk
SHUTDOWN_TIMEOUT_S = 30.0  # on SIGTERM, how long requests in flight may finish before they are cut
KEEPALIVE_S = 5.0  # an SSE comment this often while a stream is paused: proxies drop idle ones
MAX_CHOICES = 16  # `n`: copies of one prompt; more would crowd out everyone else's requests
MAX_REQUEST_ID = 128  # a longer X-Request-Id is replaced by our own
LOADING_RETRY_S = 5  # what a client is asked to wait while the model loads
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a CORS preflight's answer
# an event stream's headers (X-Accel-Buffering: nginx passes each chunk on at once)
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "Connection": "close",
}
# the SamplingParams fields a body sets by name (OpenAI's, vLLM's); `logprobs` differs per endpoint,
# `json_schema` comes from response_format or tool_choice
SAMPLING_FIELDS = [
    f.name
    for f in fields(SamplingParams)
    if f.name not in ("max_tokens", "logprobs", "json_schema")
]
# OpenAI parameters the engine cannot honour: accepted only when absent, null or this neutral value
UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": "", "functions": [], "function_call": "none"}
# every other field of a body: unknown, ignored with a warning (as vLLM does)
KNOWN_FIELDS = {
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "logprobs",
    "top_logprobs",
    "user",
    *SAMPLING_FIELDS,
    "chat_template_kwargs",
    *UNSUPPORTED,
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
}
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer system
PROMPT_TAIL_TOKENS = 16  # where a reasoning parser looks for a think block the prompt opened
ANTHROPIC_PATH = "/v1/messages"  # it, and the paths below it, answer errors in Anthropic's shape
OPEN_PATHS = ("/health", "/")  # keyless: load balancers probe /health; the page asks for the key


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


@contextmanager
def bad_request() -> Iterator[None]:
    """A ValueError inside is the client's mistake: a 400 that says it."""
    try:
        yield
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


# ---------------------------------------------------------------- the engine thread


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


@dataclass
class Choice:
    """The engine thread's record of one connection's request (one of its `n` choices)."""

    deltas: queue.Queue  # where the engine thread puts this choice's ChoiceDeltas
    index: int
    tag: str  # the X-Request-Id, for the log
    request: Request | None = None  # once the engine has added it
    sent: int = 0  # characters of stream_text(request) already sent
    sent_tokens: int = 0  # output tokens whose logprobs were sent
    queued: bool = True  # no token yet: counts against max_waiting


def stream_text(req: Request) -> str:
    """The output text that is safe to show now: a possible start of a stop string is held back."""
    if req.is_finished or not req.params.stop:
        return req.output_text
    hold = max(len(s) for s in req.params.stop) - 1
    return req.output_text[: max(0, len(req.output_text) - hold)]


class EngineLoop(threading.Thread):
    """The only thread that touches the Engine: it makes the calls in its inbox between steps."""

    def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int, live: LiveView):
        super().__init__(name="nanoflow-engine", daemon=True)
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.live = live
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # calls to make; None: stop
        self.lock = threading.Lock()  # "check the queue length, then enqueue" is one step
        self.num_queued = 0  # submitted requests without a token yet
        self.stopping = False
        self.choices: dict[str, Choice] = {}
        self.snapshot = engine.stats()

    def submit(
        self, request_ids: list[str], prompt_ids: list[int], params: list[SamplingParams], tag: str
    ) -> queue.Queue:
        """Queue a checked request's choices; their deltas will arrive on the returned queue."""
        deltas: queue.Queue = queue.Queue()
        with self.lock:
            if self.stopping:
                raise HTTPError(503, "the server is shutting down")
            retry = self.retry_after(len(prompt_ids), params[0].max_tokens)
            if retry:
                raise HTTPError(
                    503,
                    f"{self.num_queued} requests are already waiting; retry in {retry} s",
                    "overloaded",
                    {"Retry-After": str(retry)},
                )
            self.num_queued += len(request_ids)
            for i, (request_id, p) in enumerate(zip(request_ids, params)):
                choice = Choice(deltas, i, tag)
                self.inbox.put(functools.partial(self._add, request_id, prompt_ids, p, choice))
        return deltas

    def retry_after(self, prompt_tokens: int, max_tokens: int) -> int:
        """0 while fewer than max_waiting queued requests cannot start within START_BOUND_S at the
        measured prefill rate; else the seconds the decode rate needs for those over the limit."""
        s = self.engine.scheduler
        startable = int(START_BOUND_S * s.rates.prefill_rate / max(1, prompt_tokens))
        excess, batch = self.num_queued - startable - self.max_waiting + 1, max(1, len(s.running))
        seconds = excess * max_tokens * s.rates.decode_time(batch) / batch
        return max(RETRY_AFTER_S, math.ceil(seconds)) if excess > 0 else 0

    def abort(self, request_id: str) -> None:
        self.inbox.put(functools.partial(self._abort, request_id))

    def stop(self) -> None:
        """Abort every request (each choice gets its last ChoiceDelta) and end the thread."""
        with self.lock:
            self.stopping = True
            self.inbox.put(None)
        self.join()
        self.live.close()

    def run(self) -> None:
        while self._take_inbox(block=not self.engine.has_unfinished()):
            try:
                stepped = self.engine.step()
            except Exception:
                log.exception("engine step failed; aborting every request")
                self._abort_all(HTTPError(500, "the engine failed: see the server log"))
                continue
            # before the deltas, so that a finished client sees its blocks free
            self.snapshot = self.engine.stats(self.metrics.scraped)
            for req in stepped:
                self._publish(self.choices[req.request_id])
            self.live.observe(stepped)

    def _take_inbox(self, block: bool) -> bool:
        """Make the inbox's calls (waiting for one when idle); False once asked to stop."""
        # viewers see an idle engine too
        wait = SNAPSHOT_INTERVAL_S if self.live.viewers else None
        try:
            calls = [self.inbox.get(timeout=wait)] if block else []
        except queue.Empty:
            calls = []
        while not self.inbox.empty():
            calls.append(self.inbox.get())
        for call in calls:
            if call is None:
                self._abort_all()
                return False
            call()
        if calls:
            self.snapshot = self.engine.stats(self.metrics.scraped)
            self.live.observe([], fresh=True)  # viewers see new requests before a long step
        return True

    def _add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, choice: Choice
    ) -> None:
        try:
            choice.request = self.engine.add_request(prompt_ids, params, request_id)
        except Exception as e:
            # checked already; whatever still fails is this request's problem alone
            self._unqueue(choice)
            error = HTTPError(400 if isinstance(e, ValueError) else 500, str(e))
            choice.deltas.put(ChoiceDelta(error=error))
            return
        self.choices[request_id] = choice

    def _abort(self, request_id: str, error: HTTPError | None = None) -> None:
        if request_id in self.choices:
            self.engine.abort(request_id)
            self._publish(self.choices[request_id], error)

    def _abort_all(self, error: HTTPError | None = None) -> None:
        for request_id in list(self.choices):
            self._abort(request_id, error)

    def _publish(self, choice: Choice, error: HTTPError | None = None) -> None:
        """Send the text the request added since last time; at the end, its finish and usage."""
        req = choice.request
        text = stream_text(req)
        sent = choice.sent_tokens
        logprobs = list(zip(req.output_token_ids[sent:], req.logprobs[sent:]))
        delta = ChoiceDelta(
            choice.index,
            text[choice.sent :],
            logprobs,
            req.finish_reason,
            req.num_output_tokens,
            error,
            stop_reason=req.stop_reason,
        )
        choice.sent = len(text)
        choice.sent_tokens = req.num_output_tokens
        if choice.queued and (req.num_output_tokens > 0 or req.is_finished):
            self._unqueue(choice)
        if req.is_finished:
            del self.choices[req.request_id]
            self._log_finished(req, choice.tag)
        if delta.text or delta.logprobs or delta.finish_reason:
            choice.deltas.put(delta)

    def _unqueue(self, choice: Choice) -> None:
        with self.lock:
            self.num_queued -= 1
        choice.queued = False

    def _log_finished(self, req: Request, tag: str) -> None:
        record = req.record()
        rebuffer = rebuffer_time(record.token_times, record.rate)
        self.metrics.finished(req.finish_reason, len(req.prompt_token_ids), record, rebuffer)
        ttft = f"{record.ttft:.3f}s" if record.token_times else "-"
        log.info(
            "%s %s prompt=%d output=%d ttft=%s rebuffer=%.3fs finish=%s",
            tag,
            req.request_id,
            len(req.prompt_token_ids),
            req.num_output_tokens,
            ttft,
            rebuffer,
            req.finish_reason,
        )


# ---------------------------------------------------------------- a body's checks: OpenAI to engine


def check_fields(body: dict, request_id: str) -> None:
    """Unsupported OpenAI parameters are a 400; fields nobody knows are ignored, with a warning."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in (None, neutral):
            raise HTTPError(
                400,
                f"nanoflow does not support `{name}`; leave it out or set it to "
                f"{json.dumps(neutral)}",
                "unsupported_parameter",
            )
    if unknown := sorted(body.keys() - KNOWN_FIELDS):
        log.warning("%s: ignoring unknown fields %s", request_id, ", ".join(unknown))


def flag(obj: dict, name: str) -> bool:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise HTTPError(400, f"`{name}` must be true or false")
    return bool(value)


def chat_messages(body: dict) -> list[dict]:
    """`messages` as [{"role", "content"}] with string content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, '`messages` must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        with suppress(ValueError):  # a list of text parts, joined; anything else is refused below
            content = text_of(content, "content")
        # an assistant's calls without text: tools.template_messages adds them
        if content is None and isinstance(m, dict) and m.get("tool_calls"):
            content = ""
        if not (isinstance(content, str) and isinstance(m.get("role"), str)):
            raise HTTPError(400, f"messages[{i}] needs string `role` and `content` (or text parts)")
        if m["role"] not in ROLES:
            raise HTTPError(400, f"messages[{i}] has role {m['role']!r}; use {', '.join(ROLES)}")
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
    raise HTTPError(400, "`prompt` must be a string or a list of token ids (one per request)")


def prompt_of(body: dict, tokenizer, chat: bool, tools: ToolRequest | None = None) -> list[int]:
    """Token ids: chat `messages` and tools through the chat template, or `prompt` (text or ids)."""
    if not chat:
        return prompt_ids(body.get("prompt"), tokenizer)
    if not tokenizer.chat_template:
        raise HTTPError(400, "this model has no chat template; use /v1/completions with a prompt")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise HTTPError(400, "`chat_template_kwargs` must be an object")
    try:
        messages = template_messages(chat_messages(body), body["messages"], tokenizer.chat_template)
        return tokenizer.apply_chat_template(messages, **{**kwargs, "tools": tools and tools.tools})
    except (ValueError, TemplateError) as e:
        raise HTTPError(400, f"cannot apply the chat template: {e}") from None


def constraints(
    body: dict, template: str | None, chat: bool
) -> tuple[ToolRequest | None, dict | None]:
    """The request's tools and the JSON schema its output must follow (grammar.py, tools.py)."""
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise HTTPError(400, "`tools` need /v1/chat/completions")
    with bad_request():
        tools = ToolRequest.of(body, template) if chat else None
        schema = response_format_schema(body.get("response_format"))
    forced = tools.json_schema() if tools else None
    if forced is not None and schema is not None:
        raise HTTPError(
            400, "`response_format` and a forced `tool_choice` both constrain the output; send one"
        )
    return tools, schema if forced is None else forced


def sampling_params(
    body: dict, ids: list[int], engine: Engine, defaults: dict, chat: bool
) -> list[SamplingParams]:
    """Each choice's SamplingParams, the body's over the defaults, checked: the engine trusts it."""
    given = {**defaults, **{k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}}
    asked = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    room = engine.max_model_len - len(ids)
    # by default, up to the end of the context (as OpenAI and vLLM do)
    max_tokens = asked[0] if asked else max(1, room)
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=num_logprobs(body, chat), **given)
        engine.check_prompt(ids, params)
    except ValueError as e:
        raise HTTPError(400, str(e).removeprefix("SamplingParams.")) from None
    if params.max_tokens > room:
        raise HTTPError(
            400,
            f"{len(ids)} prompt tokens in a {engine.max_model_len}-token context: "
            f"max_tokens can be {room} at most",
            "context_length_exceeded",
        )
    return per_choice_params(body, params)


def num_logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives: chat's `logprobs: true, top_logprobs: k`, completions' `logprobs: k`."""
    if not chat:
        return body.get("logprobs")
    if body.get("top_logprobs") is not None and not flag(body, "logprobs"):
        raise HTTPError(400, "`top_logprobs` needs `logprobs: true`")
    return (body.get("top_logprobs") or 0) if flag(body, "logprobs") else None


def per_choice_params(body: dict, params: SamplingParams) -> list[SamplingParams]:
    """`n` copies of the request; seeded, choice i samples with seed + i (so that they differ)."""
    n = 1 if body.get("n") is None else body["n"]
    if not (type(n) is int and 1 <= n <= MAX_CHOICES):
        raise HTTPError(400, f"`n` must be an integer in [1, {MAX_CHOICES}]")
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

    def usage_chunk(self, finished: list[ChoiceDelta]) -> dict:
        return self._object([], usage=self._usage(finished))

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
    """The deltas as OpenAI streams them, in chat.completion.chunks; an error's body ends them."""
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
        yield reply.usage_chunk(done)


def finished(deltas: Iterator[ChoiceDelta]) -> list[ChoiceDelta]:
    """Every delta of a whole answer; the first error is raised instead."""
    got = list(deltas)
    if errors := [e.error for e in got if e.error]:
        raise errors[0]
    return got


# ---------------------------------------------------------------- HTTP


class Handler(BaseHTTPRequestHandler):
    """One thread per connection: route, authenticate, check, then stream or send the answer."""

    protocol_version = "HTTP/1.1"  # keep-alive for plain answers; a stream ends by closing
    server_version = "nanoflow"
    disable_nagle_algorithm = True  # a token is a few bytes: send it now, not with the next one
    timeout = CLIENT_TIMEOUT_S
    server: "Server"
    request_id = ""  # X-Request-Id: the client's, or ours

    def parse_request(self) -> bool:
        self.request_id = uuid.uuid4().hex
        ok = super().parse_request()
        given = self.headers.get("X-Request-Id", "") if ok else ""
        if given.isprintable() and 0 < len(given) <= MAX_REQUEST_ID:
            self.request_id = given
        return ok

    def _dispatch(self) -> None:
        # `//v1//models/` is `/v1/models`: clients join a base URL ending in / and a path with one
        path = re.sub("/+", "/", self.path.partition("?")[0]).rstrip("/") or "/"
        try:
            length = self._content_length()
            # say so now: the client may wait for us before it sends the body
            if length > MAX_BODY_BYTES:
                error = HTTPError(413, f"{length} bytes; the limit is {MAX_BODY_BYTES}")
                self._send_error(error, path)
                return self._discard(length)
            if path not in ROUTES:
                raise HTTPError(404, f"no such path: {path}; see {', '.join(ROUTES)}")
            # ROUTES: at the end of this file, after the handlers it names
            method, endpoint = ROUTES[path]
            if self.command == "OPTIONS":  # a browser's CORS preflight: no key, no body
                preflight = {"Allow": f"{method}, OPTIONS", **self._preflight(method)}
                return self._send(204, b"", None, preflight)
            self._check_access(path, method)
            endpoint(self)
        except HTTPError as e:
            self._send_error(e, path)

    def _check_access(self, path: str, method: str) -> None:
        """The key (unless the path is open), the method, and a loaded model."""
        keyed = self.server.api_key and path not in OPEN_PATHS
        # Anthropic's clients send the key as x-api-key
        given = [self.headers.get("Authorization", ""), f"Bearer {self.headers.get('x-api-key')}"]
        key = f"Bearer {self.server.api_key}".encode()
        if keyed and not any(hmac.compare_digest(g.encode(), key) for g in given):
            raise HTTPError(401, "send 'Authorization: Bearer <API key>'", "invalid_api_key")
        if self.command != method:
            raise HTTPError(405, f"{path} takes {method}", headers={"Allow": method})
        if self.server.engine is None and path != "/health":
            raise HTTPError(
                503, "the model is still loading", headers={"Retry-After": str(LOADING_RETRY_S)}
            )

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _dispatch

    def _allowed_origin(self) -> str | None:
        """What Access-Control-Allow-Origin tells this request's Origin; None: not allowed."""
        # no headers yet when the request line itself was bad
        origin = getattr(self, "headers", {}).get("Origin")
        allowed = self.server.allowed_origins
        if origin is not None and "*" in allowed:
            return "*"
        return origin if origin in allowed else None

    def _preflight(self, method: str) -> dict:
        if not self._allowed_origin():
            return {}
        asked = self.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
        return {
            "Access-Control-Allow-Methods": f"{method}, OPTIONS",
            "Access-Control-Allow-Headers": asked,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }

    def end_headers(self) -> None:
        """Every response names the request it answers; an allowed origin is told it may read it."""
        self.send_header("X-Request-Id", self.request_id or uuid.uuid4().hex)
        if origin := self._allowed_origin():
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Expose-Headers", "X-Request-Id")
            self.send_header("Vary", "Origin")
        super().end_headers()

    def health(self) -> None:
        state = self.server.state
        if state != "serving":
            raise HTTPError(503, f"the server is {state}", state)
        self._send_json(200, {"status": "ok"})

    def models(self) -> None:
        server = self.server
        card = {"object": "model", "created": server.created, "owned_by": "nanoflow"}
        card["max_model_len"] = server.engine.max_model_len
        data = [{"id": name, **card} for name in server.model_names]
        self._send_json(200, {"object": "list", "data": data})

    def metrics(self) -> None:
        loop, metrics = self.server.loop, self.server.metrics
        if not metrics.scraped:  # a router watches: from now on each step computes the signal
            metrics.scraped = True
            loop.inbox.put(lambda: None)  # (an idle engine thread too, to refresh its snapshot)
        text = metrics.render(loop.snapshot, loop.num_queued, self.server.model_names[0])
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def live_page(self) -> None:
        self._send(200, page(), "text/html; charset=utf-8")

    def engine_events(self) -> None:
        """Snapshots of the engine (live.py), one server-sent event each, while the viewer stays."""
        self._start_events()
        with self.server.live.watching() as version:
            # on the engine thread, which this wakes: an idle one then publishes snapshots too
            self.server.loop.inbox.put(self.server.live.restart)
            with suppress(OSError):  # the viewer left
                while snapshot := self.server.live.next(version):
                    version = snapshot["version"]
                    self._sse(snapshot)

    def engine_burst(self) -> None:
        """The page's burst, sent from here: a browser holds only six connections to one server."""
        with bad_request():
            requests = burst_requests(self._read_json(), self.server.engine)
        # nobody reads these queues: each is dropped with its finished request
        queues = []
        try:
            for ids, params in requests:
                request_id = f"burst-{uuid.uuid4().hex[:8]}"
                queues.append(self.server.loop.submit([request_id], ids, [params], request_id))
        except HTTPError as e:  # overloaded: the rest are not sent
            log.warning("burst: %d of %d requests sent: %s", len(queues), len(requests), e)
        self._send_json(200, {"submitted": len(queues), "requested": len(requests)})

    def tokenize(self) -> None:
        """vLLM's /tokenize: a `prompt` or chat `messages` to token ids."""
        body = self._read_json()
        engine = self.server.engine
        ids = prompt_of(body, engine.tokenizer, chat="messages" in body)
        vocab = engine.tokenizer.tk
        strs = [vocab.id_to_token(t) for t in ids] if flag(body, "return_token_strs") else None
        self._send_json(
            200,
            {
                "count": len(ids),
                "max_model_len": engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            },
        )

    def detokenize(self) -> None:
        tokens = self._read_json().get("tokens")
        vocab = self.server.engine.config.vocab_size
        ids = isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
        if not (ids and all(0 <= t < vocab for t in tokens)):
            raise HTTPError(400, f"`tokens` must be a list of token ids in [0, {vocab})")
        self._send_json(200, {"prompt": self.server.engine.tokenizer.decode(tokens)})

    def _generate(self, chat: bool) -> None:
        body = self._read_json()
        check_fields(body, self.request_id)
        self._run(body, chat, self._send_openai)

    def _run(self, body: dict, chat: bool, answer) -> None:
        """Check and submit a body; answer(stream, reply, deltas, n) sends what comes back."""
        server = self.server
        stream = flag(body, "stream")
        tools, schema = constraints(body, server.engine.tokenizer.chat_template, chat)
        ids = prompt_of(body, server.engine.tokenizer, chat, tools)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise HTTPError(400, "`stream_options` must be an object")
        # a whole chat answer has its usage anyway; a translation reads it from the chunks
        include_usage = flag(options, "include_usage")
        params = sampling_params(
            body, ids, server.engine, {**server.defaults, "json_schema": schema}, chat
        )
        model = body["model"] if body.get("model") in server.model_names else server.model_names[0]
        reasoning = server.reasoning_parser if chat else None
        reply = Reply(
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            model,
            chat,
            server.engine.tokenizer,
            len(ids),
            params[0].logprobs is not None,
            include_usage,
            bool(reasoning),
            tools,
        )
        n = len(params)
        request_ids = [reply.id] if n == 1 else [f"{reply.id}-{i}" for i in range(n)]
        with server.in_flight():
            queued = server.loop.submit(request_ids, ids, params, self.request_id)
            try:
                deltas = self._deltas(queued, n, keepalive=stream)
                if reasoning:  # the prompt's end may open the thinking
                    tail = server.engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])
                    deltas = split_reasoning(deltas, reasoning, tail)
                answer(stream, reply, deltas, n)
            except OSError:  # the client left (its connection closed, reset or timed out)
                self.close_connection = True
            finally:
                # frees it now if its client left
                for request_id in request_ids:
                    server.loop.abort(request_id)

    chat_completions = functools.partialmethod(_generate, chat=True)
    completions = functools.partialmethod(_generate, chat=False)

    def _send_openai(self, stream: bool, reply: Reply, deltas, n: int) -> None:
        """The whole answer, or Server-Sent Events as OpenAI sends them: a chunk per new piece."""
        if not stream:
            return self._send_json(200, reply.whole(finished(deltas)))
        self._start_events()
        for chunk in chunks(reply, deltas, n):
            self._sse(chunk)
        self.wfile.write(b"data: [DONE]\n\n")

    def _translated(self, api) -> None:
        """Anthropic's or Responses' endpoint: the body runs as chat's, the answer is translated."""
        body = self._read_json()
        with bad_request():
            chat = api.chat_body(body)
        self._run(chat, True, functools.partial(self._send_translated, api, body))

    def _send_translated(self, api, body: dict, stream: bool, reply: Reply, deltas, n: int) -> None:
        translation = api.Translation(body, reply)
        events = translation.events(chunks(reply, deltas if stream else finished(deltas), n))
        if not stream:
            list(events)  # which build the whole answer
            return self._send_json(200, translation.whole)
        self._start_events()
        for name, data in events:
            self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

    anthropic_messages = functools.partialmethod(_translated, anthropic)
    openai_responses = functools.partialmethod(_translated, responses)

    def count_tokens(self) -> None:
        """Anthropic's count_tokens: the prompt tokens that body (less max_tokens) would send."""
        with bad_request():
            chat = anthropic.chat_body({**self._read_json(), "max_tokens": 1})
        tokenizer = self.server.engine.tokenizer
        tools, _ = constraints(chat, tokenizer.chat_template, True)
        self._send_json(200, {"input_tokens": len(prompt_of(chat, tokenizer, True, tools))})

    def _deltas(self, deltas: queue.Queue, n: int, keepalive: bool) -> Iterator[ChoiceDelta]:
        """The deltas of n choices until each has its last or the client leaves; see KEEPALIVE_S."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        quiet_since = time.monotonic()
        while n:
            try:
                delta = deltas.get(timeout=POLL_S)
            except queue.Empty:
                delta = None
            if peer_closed(self.connection, poller):
                raise ConnectionAbortedError("the client left")
            if delta is not None:
                quiet_since = time.monotonic()
                yield delta
                if delta.error:
                    return
                n -= delta.finish_reason is not None
            elif keepalive and time.monotonic() - quiet_since > KEEPALIVE_S:
                self.wfile.write(b": keep-alive\n\n")
                quiet_since = time.monotonic()

    def _content_length(self) -> int:
        length = self.headers.get("Content-Length", "0")
        if not (length.isascii() and length.isdigit()):
            raise HTTPError(400, "Content-Length must be a byte count")
        return int(length)

    def _read_json(self) -> dict:
        try:
            body = json.loads(self.rfile.read(self._content_length()))
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    def _discard(self, size: int) -> None:
        """After a 413: read and drop what the client still sends, so that it reads our answer."""
        left = min(size, DRAIN_LIMIT_BYTES)
        self.connection.settimeout(DRAIN_IDLE_S)
        with suppress(OSError):  # it sends nothing more: done
            while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                left -= len(chunk)

    def _start_events(self) -> None:
        self.close_connection = True
        self._start(200, SSE_HEADERS)

    def _sse(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send(
        self, status: int, data: bytes, content_type: str | None, headers: dict | None = None
    ) -> None:
        self._start(
            status,
            {"Content-Type": content_type, "Content-Length": str(len(data)), **(headers or {})},
        )
        self.wfile.write(data)

    def _start(self, status: int, headers: dict) -> None:
        self.send_response(status)
        for name, value in headers.items():
            if value is not None:
                self.send_header(name, value)
        self.end_headers()

    def _send_error(self, e: HTTPError, path: str = "") -> None:
        self.server.metrics.rejected(e.code)
        # what is left of the request body may still be on the socket
        self.close_connection = True
        anthropic_shape = path.startswith(ANTHROPIC_PATH)
        body = anthropic.error_body(e.status, str(e)) if anthropic_shape else e.body()
        self._send_json(e.status, body, {**e.headers, "Connection": "close"})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own errors (a bad request line, huge headers) as JSON too."""
        self._send_error(HTTPError(code, message or HTTPStatus(code).phrase))

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s " + format, self.request_id, self.address_string(), *args)


ROUTES = {
    "/v1/chat/completions": ("POST", Handler.chat_completions),
    "/v1/completions": ("POST", Handler.completions),
    "/v1/models": ("GET", Handler.models),
    "/tokenize": ("POST", Handler.tokenize),
    "/detokenize": ("POST", Handler.detokenize),
    "/health": ("GET", Handler.health),
    "/metrics": ("GET", Handler.metrics),
    "/": ("GET", Handler.live_page),
    "/v1/engine/events": ("GET", Handler.engine_events),
    "/v1/engine/burst": ("POST", Handler.engine_burst),
    ANTHROPIC_PATH: ("POST", Handler.anthropic_messages),
    "/v1/messages/count_tokens": ("POST", Handler.count_tokens),
    "/v1/responses": ("POST", Handler.openai_responses),
}


def peer_closed(sock: socket.socket, poller: select.poll) -> bool:
    """Whether the client closed its end: readable with nothing to read (or reset)."""
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Server(ThreadingHTTPServer):
    """The HTTP server, its engine thread and metrics; it listens before `attach` brings a model."""

    request_queue_size = 128  # listen backlog: a burst of clients connects at once (default: 5)

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        model: str | list[str] = DEMO_MODEL_ID,
        api_key: str | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
        allowed_origins: list[str] = (),
        generation_config: dict | None = None,
        reasoning_parser: str | None = None,
    ):
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r}; known: "
                f"{', '.join(REASONING_PARSERS)}"
            )
        super().__init__((host, port), Handler)
        self.reasoning_parser = reasoning_parser
        self.model_names = [model] if isinstance(model, str) else list(model)
        self.api_key = api_key
        self.max_waiting = max_waiting
        self.allowed_origins = list(allowed_origins)
        self.generation_config = generation_config or {}
        self.created = int(time.time())
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.live: LiveView | None = None
        self.defaults: dict = {}  # sampling defaults: the model's generation_config, then ours
        self.idle = threading.Condition()
        self.num_in_flight = 0  # connections with a request in the engine

    @property
    def url(self) -> str:
        return "http://%s:%d" % self.server_address[:2]

    @property
    def state(self) -> str:
        return "loading" if self.loop is None else "draining" if self.loop.stopping else "serving"

    def attach(self, llm: LLM) -> "Server":
        self.defaults = {**llm.generation_config, **self.generation_config}
        # a bad override fails here, not in every request
        SamplingParams(**self.defaults)
        if self.defaults:
            log.info("sampling defaults where a request says nothing: %s", self.defaults)
        self.engine = llm.engine
        self.live = LiveView(llm.engine, self.model_names[0])
        self.loop = EngineLoop(llm.engine, self.metrics, self.max_waiting, self.live)
        self.loop.start()
        return self

    def start(self) -> "Server":
        threading.Thread(target=self.serve_forever, name="nanoflow-http", daemon=True).start()
        return self

    def shutdown(self, timeout: float = 0.0) -> tuple[int, int]:
        """Refuse new requests (503), let those in flight finish for up to `timeout` s, end the rest
        (streams get a last chunk and [DONE]), stop the engine, stop listening: (finished, cut)."""
        if self.loop:
            self.loop.stopping = True
        with self.idle:
            busy = self.num_in_flight
            self.idle.wait_for(lambda: self.num_in_flight == 0, timeout)
            cut = self.num_in_flight
        if self.loop:
            self.loop.stop()
        super().shutdown()
        self.server_close()
        with self.idle:
            self.idle.wait_for(lambda: self.num_in_flight == 0, SHUTDOWN_GRACE_S)
        return busy - cut, cut

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        with self.idle:
            self.num_in_flight += 1
        try:
            yield
        finally:
            with self.idle:
                self.num_in_flight -= 1
                self.idle.notify_all()


def make_server(llm: LLM | None, host: str = "127.0.0.1", port: int = 8000, **options) -> Server:
    """A Server (see its options) for `llm` (None: until `attach`) on host:port (0: any free)."""
    server = Server(host, port, **options)
    return server.attach(llm) if llm is not None else server


def model_id(ckpt: str | None) -> str:
    path = Path(ckpt or DEMO_MODEL_ID)
    return path.stem if path.suffix == ".gguf" else path.name


def json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nanoflow.serve",
        description="An OpenAI-compatible "
        f"server: {', '.join(ROUTES)} (/ watches the engine live).",
    )
    arg = p.add_argument
    arg("--ckpt", help=f"safetensors folder or .gguf file (default: {DEMO_MODEL_ID}, downloaded)")
    arg("--host", default="127.0.0.1", help="0.0.0.0: every interface (default: %(default)s)")
    arg("--port", type=int, default=8000, help="0: any free (default: %(default)s)")
    arg(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model's names in the API, the first in answers (default: the checkpoint's name)",
    )
    arg("--chat-template", type=Path, metavar="FILE", help="jinja2 template, not the model's own")
    EngineConfig.add_flags(p)
    arg(
        "--override-generation-config",
        type=json_object,
        default={},
        metavar="JSON",
        help="""sampling defaults over generation_config.json's, e.g. '{"temperature": 0.7}'""",
    )
    arg(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        help="return a thinking model's "
        "<think>...</think> apart, as reasoning_content (default: off, all in content)",
    )
    arg("--api-key", help="require 'Authorization: Bearer KEY' (not on /health)")
    arg(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="browser origins that may call the API (CORS), e.g. http://localhost:3000, or *",
    )
    arg(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="requests without a first "
        f"token (beyond those it starts within {START_BOUND_S:g} s) past which new ones get 503 "
        "with a Retry-After from the measured rates (default: %(default)s)",
    )
    arg(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds in-flight requests may take to finish (default: %(default)s)",
    )
    arg("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if dist.torchrun_rank():  # another rank of `torchrun`: LLM() runs rank 0's steps, then exits
        LLM(args.ckpt, **EngineConfig.flag_values(args))
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("nanoflow").setLevel(args.log_level.upper())
    names = args.served_model_name or [model_id(args.ckpt)]
    server = make_server(
        None,
        args.host,
        args.port,
        model=names,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        allowed_origins=args.allowed_origins,
        generation_config=args.override_generation_config,
        reasoning_parser=args.reasoning_parser,
    ).start()
    print(f"nanoflow: loading {names[0]} at {server.url}/v1", flush=True)
    llm = LLM(args.ckpt, **EngineConfig.flag_values(args))
    if args.chat_template:
        llm.tokenizer.chat_template = args.chat_template.read_text()
    server.attach(llm)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"nanoflow: serving {names[0]} at {server.url}/v1", flush=True)
    stop.wait()
    log.info(
        "shutting down: %d requests in flight may finish within %ss",
        server.num_in_flight,
        args.shutdown_timeout,
    )
    finished, cut = server.shutdown(args.shutdown_timeout)
    log.info("shut down: %d requests finished, %d cut", finished, cut)
    dist.shutdown()


if __name__ == "__main__":
    main()
