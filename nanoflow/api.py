"""The engine thread, the only one that touches the Engine while the server runs.

Connection threads (serve.py) `submit` checked requests (past `max_waiting`: a 503, its
Retry-After from `Scheduler.wait_to_admit`); between steps this thread adds and aborts them,
steps, and puts each one's new text on its queue as `ChoiceDelta`s (protocol.py). Named api.py
as the engine's side of the server's API (the size rule counts the server's modules by name);
it imports engine.py, live.py and protocol.py, never serve.py.
"""

import functools
import logging
import math
import queue
import threading
from dataclasses import dataclass

from .engine import Engine
from .live import SNAPSHOT_INTERVAL_S, LiveView
from .metrics import Metrics, rebuffer_time
from .protocol import ChoiceDelta, HTTPError
from .request import Request, SamplingParams

log = logging.getLogger("nanoflow.serve")

START_BOUND_S = 2.0  # max_waiting does not count the queued that the engine starts within this
RETRY_AFTER_S = 1  # the least an overloaded server asks a client to wait before it retries


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
    """The output text safe to show now: a possible start of a stop string is held back."""
    if req.is_finished or not req.params.stop:
        return req.output_text
    hold = max(len(s) for s in req.params.stop) - 1
    return req.output_text[: max(0, len(req.output_text) - hold)]


class EngineLoop(threading.Thread):
    """The only thread that touches the Engine: it makes its inbox's calls between steps."""

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
        """Queue a checked request's choices; their deltas arrive on the returned queue."""
        deltas: queue.Queue = queue.Queue()
        with self.lock:
            if self.stopping:
                raise HTTPError(503, "the server is shutting down")
            max_tokens = params[0].max_tokens
            wait = self.engine.scheduler.wait_to_admit(
                self.num_queued, self.max_waiting, len(prompt_ids), max_tokens, START_BOUND_S
            )
            if wait is not None:
                retry = max(RETRY_AFTER_S, math.ceil(wait))
                message = f"{self.num_queued} requests are already waiting; retry in {retry} s"
                raise HTTPError(503, message, "overloaded", {"Retry-After": str(retry)})
            self.num_queued += len(request_ids)
            for i, (request_id, p) in enumerate(zip(request_ids, params)):
                choice = Choice(deltas, i, tag)
                self.inbox.put(functools.partial(self._add, request_id, prompt_ids, p, choice))
        return deltas

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
        wait = SNAPSHOT_INTERVAL_S if self.live.viewers else None  # viewers see an idle engine too
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
        """Send the text the request added since last time; at the end, finish and usage."""
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
        prompt = len(req.prompt_token_ids)
        log.info(
            f"{tag} {req.request_id} prompt={prompt} output={req.num_output_tokens} ttft={ttft} "
            f"rebuffer={rebuffer:.3f}s finish={req.finish_reason}"
        )
