"""The HTTP front door: an OpenAI-compatible server on the standard library's `http.server`.

A connection thread (`Handler`) routes, reads a body (protocol.py; a ValueError is a 400, in
`_dispatch`), submits it to the engine thread (api.py) and sends each new piece of text at once.
`Server` listens before the model loads; `GET /`: live.py. It imports the other server modules.
"""

import argparse
import functools
import hmac
import json
import logging
import queue
import re
import select
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from . import anthropic, dist, live, protocol, responses
from .api import START_BOUND_S, EngineLoop
from .engine import LLM, Engine, EngineConfig
from .live import LiveView
from .metrics import Metrics
from .protocol import ChoiceDelta, HTTPError, Reply, chunks, finished, flag
from .reasoning import REASONING_PARSERS, split_reasoning
from .request import SamplingParams

log = logging.getLogger("nanoflow.serve")

DEMO_MODEL_ID = "SmolLM2-135M-Instruct"  # what /v1/models calls the demo checkpoint
MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt as token ids fits; a larger body is a mistake: 413
DRAIN_LIMIT_BYTES = 64 << 20  # after our 413, what the client still sends is read and dropped...
DRAIN_IDLE_S = 1.0  # ...while it keeps sending (a client that waits for our answer sends nothing)
DEFAULT_MAX_WAITING = 256  # requests without a first token yet; more would only wait longer: 503
POLL_S = 0.05  # how often a waiting connection checks that its client is still there: ~one step
CLIENT_TIMEOUT_S = 60.0  # a client silent this long (headers, body, an unread stream) is dropped
SHUTDOWN_GRACE_S = 5.0  # how long shutdown waits for aborted streams to write their last chunk
SHUTDOWN_TIMEOUT_S = 30.0  # on SIGTERM, how long requests in flight may finish before they are cut
KEEPALIVE_S = 5.0  # an SSE comment this often while a stream is paused: proxies drop idle ones
MAX_REQUEST_ID = 128  # a longer X-Request-Id is replaced by our own
LOADING_RETRY_S = 5  # what a client is asked to wait while the model loads
PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a CORS preflight's answer
SSE_HEADERS = {  # an event stream's
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx passes each chunk on at once
    "Connection": "close",
}
PROMPT_TAIL_TOKENS = 16  # where a reasoning parser looks for a think block the prompt opened
ANTHROPIC_PATH = "/v1/messages"  # it, and the paths below it, answer errors in Anthropic's shape
OPEN_PATHS = ("/health", "/")  # keyless: load balancers probe /health; the page asks for the key


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
                return self.send_bytes(204, b"", None, preflight)
            self._check_access(path, method)
            endpoint(self)
        except ValueError as e:  # the request's own mistake (protocol.py, Engine.check_prompt)
            self._send_error(HTTPError(400, str(e).removeprefix("SamplingParams.")), path)
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
            retry = {"Retry-After": str(LOADING_RETRY_S)}
            raise HTTPError(503, "the model is still loading", headers=retry)

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
        """Each response names its request; an allowed origin is told it may read it."""
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
        self.send_json(200, {"status": "ok"})

    def models(self) -> None:
        server = self.server
        card = {"object": "model", "created": server.created, "owned_by": "nanoflow"}
        card["max_model_len"] = server.engine.max_model_len
        data = [{"id": name, **card} for name in server.model_names]
        self.send_json(200, {"object": "list", "data": data})

    def metrics(self) -> None:
        loop = self.server.loop
        metrics = self.server.metrics
        if not metrics.scraped:  # a router watches: from now on each step computes the signal
            metrics.scraped = True
            loop.inbox.put(lambda: None)  # (an idle engine thread too, to refresh its snapshot)
        text = metrics.render(loop.snapshot, loop.num_queued, self.server.model_names[0])
        self.send_bytes(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def load(self) -> None:
        """vLLM's router's load report (/get_load) and vLLM's (/load): requests in the engine."""
        load = self.server.num_in_flight
        self.send_json(200, {"load": load, "server_load": load})

    def tokenize(self) -> None:
        """vLLM's /tokenize: a `prompt` or chat `messages` to token ids."""
        body = self.read_json()
        engine = self.server.engine
        ids = protocol.prompt_of(body, engine.tokenizer, chat="messages" in body)
        vocab = engine.tokenizer.tk
        strs = [vocab.id_to_token(t) for t in ids] if flag(body, "return_token_strs") else None
        answer = {"count": len(ids), "max_model_len": engine.max_model_len}
        self.send_json(200, {**answer, "tokens": ids, "token_strs": strs})

    def detokenize(self) -> None:
        tokens = self.read_json().get("tokens")
        vocab = self.server.engine.config.vocab_size
        ids = isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
        if not (ids and all(0 <= t < vocab for t in tokens)):
            raise HTTPError(400, f"`tokens` must be a list of token ids in [0, {vocab})")
        self.send_json(200, {"prompt": self.server.engine.tokenizer.decode(tokens)})

    def chat_completions(self) -> None:
        self._openai(chat=True)

    def completions(self) -> None:
        self._openai(chat=False)

    def _openai(self, chat: bool) -> None:
        body = self.read_json()
        protocol.check_fields(body, self.request_id)
        self._run(body, chat, self._send_openai)

    def _run(self, body: dict, chat: bool, answer) -> None:
        """Check and submit a body; answer(stream, reply, deltas, n) sends what comes back."""
        server = self.server
        stream = flag(body, "stream")
        tools, schema = protocol.constraints(body, server.engine.tokenizer.chat_template, chat)
        ids = protocol.prompt_of(body, server.engine.tokenizer, chat, tools)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise HTTPError(400, "`stream_options` must be an object")
        # a whole chat answer has its usage anyway; a translation reads it from the chunks
        include_usage = flag(options, "include_usage")
        params = protocol.sampling_params(
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
                for request_id in request_ids:  # frees it now if its client left
                    server.loop.abort(request_id)

    def _send_openai(self, stream: bool, reply: Reply, deltas, n: int) -> None:
        """The whole answer, or Server-Sent Events as OpenAI sends them: a chunk per new piece."""
        if not stream:
            return self.send_json(200, reply.whole(finished(deltas)))
        self.start_events()
        for chunk in chunks(reply, deltas, n):
            self.sse(chunk)
        self.wfile.write(b"data: [DONE]\n\n")

    def anthropic_messages(self) -> None:
        self._translated(anthropic)

    def openai_responses(self) -> None:
        self._translated(responses)

    def _translated(self, api) -> None:
        """The body runs as chat's; the answer is translated back into api's shape."""
        body = self.read_json()
        self._run(api.chat_body(body), True, functools.partial(self._send_translated, api, body))

    def _send_translated(self, api, body: dict, stream: bool, reply: Reply, deltas, n: int) -> None:
        translation = api.Translation(body, reply)
        events = translation.events(chunks(reply, deltas if stream else finished(deltas), n))
        if not stream:
            list(events)  # which build the whole answer
            return self.send_json(200, translation.whole)
        self.start_events()
        for name, data in events:
            self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

    def count_tokens(self) -> None:
        """Anthropic's count_tokens: the prompt tokens that body (less max_tokens) would send."""
        chat = anthropic.chat_body({**self.read_json(), "max_tokens": 1})
        tokenizer = self.server.engine.tokenizer
        tools, _ = protocol.constraints(chat, tokenizer.chat_template, True)
        ids = protocol.prompt_of(chat, tokenizer, True, tools)
        self.send_json(200, {"input_tokens": len(ids)})

    def _deltas(self, deltas: queue.Queue, n: int, keepalive: bool) -> Iterator[ChoiceDelta]:
        """The deltas of n choices until each ends or the client leaves (see KEEPALIVE_S)."""
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

    def read_json(self) -> dict:
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

    def start_events(self) -> None:
        self.close_connection = True
        self._start(200, SSE_HEADERS)

    def sse(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self.send_bytes(status, json.dumps(obj).encode(), "application/json", headers)

    def send_bytes(
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
        self.send_json(e.status, body, {**e.headers, "Connection": "close"})

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
    "/get_load": ("GET", Handler.load),
    "/load": ("GET", Handler.load),
    "/": ("GET", live.live_page),
    "/v1/engine/events": ("GET", live.engine_events),
    "/v1/engine/burst": ("POST", live.engine_burst),
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
    """The HTTP server, its engine thread, metrics; listens before `attach` brings a model."""

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
            known = ", ".join(REASONING_PARSERS)
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {known}")
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
        if self.loop is None:
            return "loading"
        return "draining" if self.loop.stopping else "serving"

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
    description = f"An OpenAI-compatible server: {', '.join(ROUTES)} (/ watches the engine live)."
    p = argparse.ArgumentParser(prog="python -m nanoflow.serve", description=description)
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
    # a timeout: a signal the kernel gave another thread runs its handler here only once we wake
    while not stop.wait(0.5):
        pass
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
