"""The HTTP front door: an OpenAI-compatible server on the standard library's `http.server`.

Where it sits: a connection thread parses and validates a request, applies the chat
template, tokenizes, and hands the prompt to the engine thread through a thread-safe inbox. The
engine thread is the only one that touches the Engine: it adds and aborts requests, runs
`engine.step()`, and after every step puts each request's new text on that request's own queue.
The connection thread writes that text to its socket at once (one SSE chunk per detokenized token)
and aborts the request as soon as its client goes away. `/metrics` reads the `engine.stats()`
snapshot that the engine thread publishes after each step, plus the server's own counters.

    python -m nanoflow.serve --ckpt ./llama3-8b --port 8000
"""

import argparse
import bisect
import hmac
import json
import logging
import queue
import select
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from jinja2 import TemplateError

from .engine import LLM, Engine
from .metrics import RequestRecord, rebuffer_time
from .sched import Request, SamplingParams, TokenFlowConfig

log = logging.getLogger("nanoflow.serve")

DEMO_MODEL_ID = "SmolLM2-135M-Instruct"  # what /v1/models calls the demo checkpoint
MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt sent as token ids fits; a larger body is a mistake: 413
DRAIN_LIMIT_BYTES = 64 << 20  # a too-large body is read and dropped up to here, so the client sees our 413
DEFAULT_MAX_WAITING = 256  # requests still waiting for a first token; more would only wait longer: 503
RETRY_AFTER_S = 1  # what an overloaded server asks a client to wait before it retries
POLL_S = 0.05  # how often a waiting connection checks that its client is still there: about one step
CLIENT_TIMEOUT_S = 60.0  # a client silent this long (slow headers or body, a stream it stopped reading) is dropped
SHUTDOWN_GRACE_S = 5.0  # how long shutdown waits for aborted streams to write their last chunk
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "read_rate")
# OpenAI parameters the engine cannot honour: accepted only when absent, null or set to this neutral value
UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": False, "top_logprobs": 0, "echo": False, "suffix": "",
               "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0, "tools": [], "tool_choice": "none",
               "functions": [], "function_call": "none", "response_format": {"type": "text"}}
ENGINE_GAUGES = {"running", "waiting", "preempted"}  # engine.stats() keys that are levels; the rest count since start
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.3, 2.5, 5.0, 10.0, 30.0)  # s; 1.3 s is where users give up
TBT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)  # s; a reader at 8 tok/s needs < 0.125
LLM_OPTIONS = ("device", "dtype", "num_kv_blocks", "policy", "read_rate", "host_kv_gb", "tokenflow")  # CLI flags for LLM(...)


class HTTPError(Exception):
    """An error answered as OpenAI does: a status and {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.code = code or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")

    def body(self) -> dict:
        kind = ("authentication_error" if self.status == 401 else
                "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "code": self.code}}


class ClientGone(ConnectionError):
    """The client closed its connection while its request was in flight."""


# ---------------------------------------------------------------- the engine thread


@dataclass
class Event:
    """What the engine thread tells a connection: new text and, at the end, why it stopped."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    error: HTTPError | None = None


@dataclass
class Stream:
    """The engine thread's record of one connection's request."""

    events: queue.Queue
    request: Request | None = None  # once the engine has added it
    sent: int = 0  # characters of stream_text() already sent
    queued: bool = True  # no token yet: counts against max_waiting


class EngineLoop(threading.Thread):
    """The only thread that touches the Engine; connections talk to it through `submit` and `abort`."""

    def __init__(self, engine: Engine, metrics: "Metrics", max_waiting: int):
        super().__init__(name="nanoflow-engine", daemon=True)
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # makes "check the queue length, then enqueue" one step for racing submits
        self.num_queued = 0  # submitted requests without a token yet
        self.stopping = False
        self.streams: dict[str, Stream] = {}
        self.snapshot = engine.stats()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> queue.Queue:
        """Queue a validated request; its Events will arrive on the returned queue."""
        events: queue.Queue = queue.Queue()
        with self.lock:
            if self.stopping:
                raise HTTPError(503, "the server is shutting down")
            if self.num_queued >= self.max_waiting:
                raise HTTPError(503, f"{self.num_queued} requests are already waiting; retry shortly", "overloaded",
                                {"Retry-After": str(RETRY_AFTER_S)})
            self.num_queued += 1
            self.inbox.put(("add", request_id, (prompt_ids, params, events)))
        return events

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id, None))

    def stop(self) -> None:
        """Abort every request (each stream gets its last Event) and end the thread."""
        with self.lock:
            self.stopping = True
            self.inbox.put(("stop", None, None))
        self.join()

    def run(self) -> None:
        while self._take_inbox(block=not self.engine.has_unfinished()):
            try:
                done = self.engine.step()
            except Exception:
                log.exception("engine step failed; aborting every request")
                self._abort_all(HTTPError(500, "the engine failed while running this request; see the server log"))
                continue
            self.snapshot = self.engine.stats()  # before the Events, so a finished client sees its blocks free
            for req in done:
                self._publish(self.streams[req.request_id])

    def _take_inbox(self, block: bool) -> bool:
        """Apply every pending add and abort (waiting for one when idle); False once asked to stop."""
        items = [self.inbox.get()] if block else []
        while not self.inbox.empty():
            items.append(self.inbox.get())
        for kind, request_id, payload in items:
            if kind == "stop":
                self._abort_all()
                return False
            if kind == "add":
                self._add(request_id, *payload)
            elif request_id in self.streams:
                self.engine.abort(request_id)
                self._publish(self.streams[request_id])
        if items:
            self.snapshot = self.engine.stats()
        return True

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, events: queue.Queue) -> None:
        stream = Stream(events)
        try:
            stream.request = self.engine.add_request(prompt_ids, params, request_id)
        except Exception as e:  # validated already; whatever still fails is this request's problem alone
            self._unqueue(stream)
            events.put(Event(error=HTTPError(400 if isinstance(e, ValueError) else 500, str(e))))
            return
        self.streams[request_id] = stream

    def _abort_all(self, error: HTTPError | None = None) -> None:
        for request_id, stream in list(self.streams.items()):
            self.engine.abort(request_id)
            self._publish(stream, error)

    def _publish(self, stream: Stream, error: HTTPError | None = None) -> None:
        """Send the text the request added since last time; at the end, its finish reason and usage."""
        req = stream.request
        text = req.stream_text()
        event = Event(text[stream.sent:], req.finish_reason, error=error)
        stream.sent = len(text)
        if stream.queued and (req.num_output_tokens or req.is_finished):
            self._unqueue(stream)
        if req.is_finished:
            del self.streams[req.request_id]
            event.usage = {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": req.num_output_tokens,
                           "total_tokens": req.num_tokens}
            self._log_finished(req)
        if event.text or event.finish_reason:
            stream.events.put(event)

    def _unqueue(self, stream: Stream) -> None:
        with self.lock:
            self.num_queued -= 1
        stream.queued = False

    def _log_finished(self, req) -> None:
        record = req.record()
        rebuffer = rebuffer_time(record.token_times, record.rate)
        self.metrics.finished(req.finish_reason, len(req.prompt_token_ids), record, rebuffer)
        ttft = f"{record.ttft:.3f}s" if record.token_times else "-"
        log.info("%s prompt=%d output=%d ttft=%s rebuffer=%.3fs finish=%s", req.request_id,
                 len(req.prompt_token_ids), req.num_output_tokens, ttft, rebuffer, req.finish_reason)


# ---------------------------------------------------------------- /metrics


class Histogram:
    """A Prometheus histogram: counts per bucket upper bound, a sum and a count."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]


class Metrics:
    """The server's counters and histograms; rendered with a snapshot of the engine's stats."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.tokens = {"prompt": 0, "generation": 0}
        self.ttft = Histogram("nanoflow_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tbt = Histogram("nanoflow_time_between_tokens_seconds", "Gap between consecutive tokens.", TBT_BUCKETS)
        self.rebuffer = Histogram("nanoflow_rebuffer_seconds", "Time a request's reader stalled (docs/scheduling.md).",
                                  TTFT_BUCKETS)

    def rejected(self, code: str) -> None:
        with self.lock:
            self.outcomes[code] += 1

    def finished(self, reason: str, prompt_tokens: int, record: RequestRecord, rebuffer: float) -> None:
        with self.lock:
            self.outcomes[reason] += 1
            self.tokens["prompt"] += prompt_tokens
            self.tokens["generation"] += len(record.token_times)
            if record.token_times:
                self.ttft.observe(record.ttft)
                self.rebuffer.observe(rebuffer)
            for a, b in zip(record.token_times, record.token_times[1:]):
                self.tbt.observe(b - a)

    def render(self, stats: dict, num_queued: int) -> str:
        with self.lock:
            out = ["# HELP nanoflow_requests_total Requests by outcome: finish reason, or the error code.",
                   "# TYPE nanoflow_requests_total counter"]
            out += [f'nanoflow_requests_total{{outcome="{k}"}} {n}' for k, n in sorted(self.outcomes.items())]
            out += ["# TYPE nanoflow_tokens_total counter"]
            out += [f'nanoflow_tokens_total{{kind="{k}"}} {n}' for k, n in self.tokens.items()]
            out += ["# HELP nanoflow_queued_requests Requests without a first token (compared with --max-waiting).",
                    "# TYPE nanoflow_queued_requests gauge", f"nanoflow_queued_requests {num_queued}"]
            out += self.ttft.lines() + self.tbt.lines() + self.rebuffer.lines()
        return "\n".join(out + engine_lines(stats)) + "\n"


def engine_lines(stats: dict) -> list[str]:
    """Every numeric engine.stats() key: levels as gauges, the rest as counters; `X_blocks_used` too."""
    out = []
    for key, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        gauge = key in ENGINE_GAUGES or "_blocks_" in key
        name = f"nanoflow_{key}" if gauge else f"nanoflow_{key}_total"
        out += [f"# TYPE {name} {'gauge' if gauge else 'counter'}", f"{name} {value}"]
        total = stats.get(key.removesuffix("_free") + "_total")
        if key.endswith("_blocks_free") and total is not None:
            used = f"nanoflow_{key.removesuffix('_free')}_used"
            out += [f"# TYPE {used} gauge", f"{used} {total - value}"]
    return out


# ---------------------------------------------------------------- requests: OpenAI fields to engine inputs


def check_supported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in (None, neutral):
            raise HTTPError(400, f"nanoflow does not support `{name}`; leave it out or set it to "
                                 f"{json.dumps(neutral)}", "unsupported_parameter")


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
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "\n".join(p["text"] for p in content)
        if not (isinstance(content, str) and isinstance(m.get("role"), str)):
            raise HTTPError(400, f"messages[{i}] needs a string `role` and a string `content` (or text parts)")
        out.append({"role": m["role"], "content": content})
    return out


def prompt_ids(prompt, tokenizer) -> list[int]:
    """`prompt` as text or token ids; a batch of one is unwrapped (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise HTTPError(400, "`prompt` must be a string or a list of token ids (one prompt per request)")


def sampling_params(body: dict, ids: list[int], engine: Engine) -> SamplingParams:
    """SamplingParams from the body's OpenAI fields; a value the engine cannot honour is a 400."""
    fields = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    room = engine.max_model_len - len(ids)
    try:  # by default, up to the end of the context (as OpenAI and vLLM do)
        params = SamplingParams(max_tokens=max(1, room) if max_tokens is None else max_tokens, **fields)
        engine.check_prompt(ids, params)
    except ValueError as e:
        raise HTTPError(400, str(e).removeprefix("SamplingParams.")) from None
    if params.max_tokens > room:
        raise HTTPError(400, f"the model's context is {engine.max_model_len} tokens: the prompt has {len(ids)} and "
                             f"max_tokens asks for {params.max_tokens} more; ask for at most {room}",
                        "context_length_exceeded")
    return params


@dataclass
class Reply:
    """Builds the OpenAI objects of one response: chat.completion(.chunk) or text_completion."""

    id: str
    model: str
    chat: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    @staticmethod
    def _choice(finish_reason: str | None, **content) -> dict:
        return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, text: str = "", finish_reason: str | None = None, role: bool = False) -> dict:
        usage = {"usage": None} if self.include_usage else {}
        if not self.chat:
            return self._object("text_completion", [self._choice(finish_reason, text=text)], **usage)
        delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
        return self._object("chat.completion.chunk", [self._choice(finish_reason, delta=delta)], **usage)

    def usage_chunk(self, usage: dict) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if not self.chat:
            return self._object("text_completion", [self._choice(finish_reason, text=text)], usage=usage)
        message = {"role": "assistant", "content": text}
        return self._object("chat.completion", [self._choice(finish_reason, message=message)], usage=usage)


# ---------------------------------------------------------------- HTTP


class Handler(BaseHTTPRequestHandler):
    """One thread per connection: route, authenticate, validate, then stream or send the answer."""

    protocol_version = "HTTP/1.1"  # keep-alive for plain answers; a stream ends by closing the connection
    server_version = "nanoflow"
    disable_nagle_algorithm = True  # a token is a few bytes: send it now, not together with the next one
    timeout = CLIENT_TIMEOUT_S
    server: "Server"

    def _dispatch(self) -> None:
        path = urlsplit(self.path).path
        try:
            if self.server.api_key and path != "/health":  # load balancers probe /health without a key
                self._authenticate()
            if path not in ROUTES:
                raise HTTPError(404, f"no such path: {path}; see /v1/chat/completions, /v1/completions, "
                                     "/v1/models, /health, /metrics")
            method, endpoint = ROUTES[path]
            if self.command != method:
                raise HTTPError(405, f"{path} takes {method}", headers={"Allow": method})
            endpoint(self)
        except HTTPError as e:
            self._send_error(e)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    def _authenticate(self) -> None:
        given = self.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.server.api_key}".encode()):
            raise HTTPError(401, "a valid API key is required: send 'Authorization: Bearer <key>'", "invalid_api_key")

    # ---- endpoints

    def health(self) -> None:
        self._send_json(200, {"status": "ok"})

    def models(self) -> None:
        model = {"id": self.server.model, "object": "model", "created": self.server.created, "owned_by": "nanoflow"}
        self._send_json(200, {"object": "list", "data": [model]})

    def metrics(self) -> None:
        loop = self.server.loop
        text = self.server.metrics.render(loop.snapshot, loop.num_queued)
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def chat_completions(self) -> None:
        body = self._read_json()
        check_supported(body)
        tokenizer = self.server.engine.tokenizer
        if not tokenizer.chat_template:
            raise HTTPError(400, "this model has no chat template; send a plain prompt to /v1/completions")
        try:
            ids = tokenizer.apply_chat_template(chat_messages(body))
        except (ValueError, TemplateError) as e:
            raise HTTPError(400, f"cannot apply the chat template: {e}") from None
        self._generate(body, ids, Reply(f"chatcmpl-{uuid.uuid4().hex}", self.server.model, chat=True))

    def completions(self) -> None:
        body = self._read_json()
        check_supported(body)
        ids = prompt_ids(body.get("prompt"), self.server.engine.tokenizer)
        self._generate(body, ids, Reply(f"cmpl-{uuid.uuid4().hex}", self.server.model, chat=False))

    # ---- generation

    def _generate(self, body: dict, ids: list[int], reply: Reply) -> None:
        stream = flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise HTTPError(400, "`stream_options` must be an object")
        reply.include_usage = stream and flag(options, "include_usage")
        params = sampling_params(body, ids, self.server.engine)
        with self.server.in_flight():
            events = self.server.loop.submit(reply.id, ids, params)
            try:
                (self._stream if stream else self._answer)(reply, events)
            except OSError:  # the client left (ClientGone, a broken pipe, a reset, a write timeout)
                self.close_connection = True
            finally:
                self.server.loop.abort(reply.id)  # a no-op once finished; frees it at once if its client left

    def _stream(self, reply: Reply, events: queue.Queue) -> None:
        """Server-Sent Events as OpenAI sends them, one chunk per piece of text as soon as it exists."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if reply.chat:
            self._sse(reply.chunk(role=True))
        for event in self._events(events):
            if event.error:
                self._sse(event.error.body())
                break
            if event.text:
                self._sse(reply.chunk(event.text))
            if event.finish_reason:
                self._sse(reply.chunk(finish_reason=event.finish_reason))
                if reply.include_usage:
                    self._sse(reply.usage_chunk(event.usage))
        self.wfile.write(b"data: [DONE]\n\n")

    def _answer(self, reply: Reply, events: queue.Queue) -> None:
        pieces = []
        for event in self._events(events):
            if event.error:
                raise event.error
            pieces.append(event.text)
        self._send_json(200, reply.whole("".join(pieces), event.finish_reason, event.usage))

    def _events(self, events: queue.Queue) -> Iterator[Event]:
        """The request's Events until its last; raises ClientGone as soon as the client has left."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        while True:
            try:
                event = events.get(timeout=POLL_S)
            except queue.Empty:
                event = None
            if peer_closed(self.connection, poller):
                raise ClientGone
            if event is not None:
                yield event
                if event.finish_reason or event.error:
                    return

    # ---- reading and writing

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length", "0")
        if not (length.isascii() and length.isdigit()):
            raise HTTPError(400, "Content-Length must be a byte count")
        if int(length) > MAX_BODY_BYTES:
            self._discard(int(length))
            raise HTTPError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            body = json.loads(self.rfile.read(int(length)))
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object")
        return body

    def _discard(self, size: int) -> None:
        """Read and drop a too-large body, so that the client reads our 413 rather than a reset."""
        left = min(size, DRAIN_LIMIT_BYTES)
        while left > 0 and (chunk := self.rfile.read(min(left, 1 << 16))):
            left -= len(chunk)

    def _sse(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: HTTPError) -> None:
        self.server.metrics.rejected(e.code)
        self.close_connection = True  # what is left of the request body may still be on the socket
        self._send_json(e.status, e.body(), {**e.headers, "Connection": "close"})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own errors (a bad request line, headers too large) as OpenAI JSON too."""
        self._send_error(HTTPError(code, message or HTTPStatus(code).phrase))

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)


ROUTES = {"/v1/chat/completions": ("POST", Handler.chat_completions), "/v1/completions": ("POST", Handler.completions),
          "/v1/models": ("GET", Handler.models), "/health": ("GET", Handler.health),
          "/metrics": ("GET", Handler.metrics)}


def peer_closed(sock: socket.socket, poller: select.poll) -> bool:
    """Whether the client closed its end: readable with nothing to read (or reset)."""
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Server(ThreadingHTTPServer):
    """The HTTP server with its engine thread and metrics; `start()` serves in the background."""

    request_queue_size = 128  # listen backlog: a burst of clients connects at once (the default is 5)

    def __init__(self, llm: LLM, host: str, port: int, model: str, api_key: str | None, max_waiting: int):
        super().__init__((host, port), Handler)
        self.engine, self.model, self.api_key = llm.engine, model, api_key
        self.created = int(time.time())
        self.metrics = Metrics()
        self.loop = EngineLoop(llm.engine, self.metrics, max_waiting)
        self.idle = threading.Condition()
        self.num_in_flight = 0  # connections with a request in the engine

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Server":
        self.loop.start()
        threading.Thread(target=self.serve_forever, name="nanoflow-http", daemon=True).start()
        return self

    def shutdown(self) -> None:
        """End every request in flight (streams get a last chunk and [DONE]), stop the engine, stop accepting.

        The engine stops first so that in-flight streams end at once; a request that arrives meanwhile gets 503.
        """
        self.loop.stop()
        super().shutdown()
        self.server_close()
        with self.idle:
            self.idle.wait_for(lambda: self.num_in_flight == 0, SHUTDOWN_GRACE_S)

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


def make_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000, *, model: str = DEMO_MODEL_ID,
                api_key: str | None = None, max_waiting: int = DEFAULT_MAX_WAITING) -> Server:
    """A server for `llm` on host:port (0 picks a free port); call `.start()`, later `.shutdown()`."""
    return Server(llm, host, port, model, api_key, max_waiting)


def model_id(ckpt: str | None) -> str:
    if ckpt is None:
        return DEMO_MODEL_ID
    path = Path(ckpt)
    return path.stem if path.suffix == ".gguf" else path.name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanoflow.serve", description="An OpenAI-compatible server for "
                                "nanoflow: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.")
    p.add_argument("--ckpt", help="checkpoint folder (safetensors) or .gguf file; default: the demo "
                   f"{DEMO_MODEL_ID}, downloaded once")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine "
                   "only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--policy", choices=["tokenflow", "fcfs"], help="scheduling policy (default: the engine's; "
                   "fcfs is the vLLM/SGLang baseline)")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto: the checkpoint's 16-bit dtype on GPU "
                   "(else bfloat16), nanoflow.model.CPU_DTYPE on CPU (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks in device memory (default: what free memory holds)")
    p.add_argument("--host-kv-gb", type=float, help="host memory for KV swapped out of the device, in GB")
    p.add_argument("--read-rate", type=float, help="tokens/s a request's reader reads when the request declares "
                   "no read_rate (default: the engine's, 8)")
    p.add_argument("--tokenflow", type=TokenFlowConfig.parse, metavar="KEY=VALUE,...",
                   help=f"TokenFlow's constants (docs/scheduling.md; defaults: {TokenFlowConfig.help()})")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every path but /health")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, help="requests waiting for their "
                   "first token beyond which new ones get 503 with Retry-After (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    llm = LLM(args.ckpt, **{k: getattr(args, k) for k in LLM_OPTIONS if getattr(args, k) is not None})
    server = make_server(llm, args.host, args.port, model=model_id(args.ckpt), api_key=args.api_key,
                         max_waiting=args.max_waiting)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"nanoflow: serving {server.model} at {server.url}/v1", flush=True)
    stop.wait()
    log.info("shutting down: ending %d requests in flight", server.num_in_flight)
    server.shutdown()


if __name__ == "__main__":
    main()
