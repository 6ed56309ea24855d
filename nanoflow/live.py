"""The live view: what the page at `GET /` (live.html) shows, several times a second.

While a browser watches, the engine thread builds snapshots (a row per request with its reader's
buffer, the KV pools, tokens/s, recent preemptions and resumes); viewers' threads send them as SSE.
At the end, its endpoints (page, snapshots, burst); it imports engine, request and protocol.
"""

import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from importlib import resources

from .engine import Engine
from .protocol import HTTPError
from .request import Request, RequestStatus, SamplingParams

log = logging.getLogger("nanoflow.serve")

SNAPSHOT_INTERVAL_S = 0.2  # five frames a second: buffers move smoothly; one costs ~0.1 ms to build
BUSY_HINT_S = 1.0  # no snapshot for this long: a long step (a prefill on a CPU); the page says so
RECENT_EVENTS = 30  # preemptions and resumes a snapshot carries, the newest last
MAX_BURST = 512  # requests one burst may send: twice the server's default --max-waiting
SNAPSHOT_STATS = ("preemptions", "resumes_load", "resumes_recompute", "running", "waiting")
PAUSED = ("paused on host", "retracted")  # a preempted request's KV waits on host, or was dropped


def page() -> bytes:
    return resources.files(__package__).joinpath("live.html").read_bytes()


class LiveView:
    """Snapshots: the engine thread builds them, viewers' threads wait for them."""

    def __init__(self, engine: Engine, model: str):
        self.engine = engine
        self.model = model
        self.changed = threading.Condition()
        self.viewers = 0
        self.version = 0
        self.snapshot: dict | None = None
        self.closed = False
        # a page that reconnects to another server (a restart) starts afresh
        self.server_id = uuid.uuid4().hex
        self.built_at = float("-inf")
        self.stepped_at = engine.clock()  # when the engine thread last came between steps
        self.counting_since = float("-inf")
        self.tokens = 0  # tokens generated since counting_since
        self.tokens_per_s: float | None = None
        self.draining: dict[str, Request] = {}  # finished, their readers still reading
        self.states: dict[str, str] = {}  # each request's state in the last snapshot
        self.events: deque[dict] = deque(maxlen=RECENT_EVENTS)

    @contextmanager
    def watching(self) -> Iterator[int]:
        """Count a viewer in while inside; gives the version to wait past."""
        with self.changed:
            self.viewers += 1
            version = self.version
        try:
            yield version
        finally:
            with self.changed:
                self.viewers -= 1

    def next(self, version: int) -> dict | None:
        """The newest snapshot once past `version`; None once closed. Past BUSY_HINT_S without one,
        only {"version", "busy_s"}: the engine thread has been in one step for busy_s seconds."""
        with self.changed:
            self.changed.wait_for(lambda: self.version > version or self.closed, BUSY_HINT_S)
            if self.closed:
                return None
            if self.version > version:
                return self.snapshot
            return {"version": self.version, "busy_s": self.engine.clock() - self.stepped_at}

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def restart(self) -> None:
        """A viewer arrived: publish after the next step, counting tokens/s afresh."""
        self.built_at = self.counting_since = float("-inf")
        self.tokens = 0

    def observe(self, done: list[Request], fresh: bool = False) -> None:
        """After a step (`done`: the requests that got a token), publish a snapshot when one is due;
        `fresh`: the engine thread has just taken new requests, publish now (before a long step)."""
        now = self.stepped_at = self.engine.clock()
        if not self.viewers:
            return
        self.tokens += len(done)
        self.draining.update((r.request_id, r) for r in done if r.is_finished)
        if now - self.built_at < SNAPSHOT_INTERVAL_S and not fresh:
            return
        snapshot = self.build(now)
        with self.changed:
            self.version += 1
            self.snapshot = {**snapshot, "version": self.version}
            self.changed.notify_all()

    def build(self, now: float) -> dict:
        engine = self.engine
        self.draining = {i: r for i, r in self.draining.items() if r.dry_at > now}
        reqs = [*engine.requests.values(), *self.draining.values()]
        reqs.sort(key=lambda r: r.arrival_time)
        rows = [request_row(r, now) for r in reqs]
        self._note_events(reqs, rows)
        gap = now - self.counting_since
        if gap >= SNAPSHOT_INTERVAL_S:  # a fresh snapshot soon after another keeps the last rate
            self.tokens_per_s = self.tokens / gap if math.isfinite(gap) else None
            self.counting_since = now
            self.tokens = 0
        self.built_at = now
        stats = engine.stats()
        pools = {}
        for pool in ("device", "host"):  # [used, total]
            total = stats[f"{pool}_blocks_total"]
            pools[f"{pool}_blocks"] = [total - stats[f"{pool}_blocks_free"], total]
        return {
            "server": self.server_id,
            "model": self.model,
            "policy": type(engine.scheduler.policy).__name__.lower(),
            "tokens_per_s": self.tokens_per_s,
            "rows": rows,
            "events": list(self.events),
            **{k: stats[k] for k in SNAPSHOT_STATS},
            **pools,
        }

    def _note_events(self, reqs: list[Request], rows: list[dict]) -> None:
        """Turn each request's change of state since the last snapshot into an event."""
        for req, row in zip(reqs, rows):
            before = self.states.get(row["id"])
            if row["state"] in PAUSED and before not in PAUSED:
                self._event(row, f"{row['state']} {paused_with(row['buffer_s'])}")
            elif before in PAUSED and row["state"] not in PAUSED:
                self._event(row, f"resumed by {'load' if req.num_host_tokens else 'recompute'}")
        self.states = {row["id"]: row["state"] for row in rows}

    def _event(self, row: dict, what: str) -> None:
        self.events.append({"time": time.time(), "id": row["id"], "what": what})


def paused_with(buffer_s: float | None) -> str:
    if buffer_s is None:
        return "before its first token"
    return "while stalling" if buffer_s < 0 else f"with {buffer_s:.1f} s of buffer"


def request_state(req: Request) -> str:
    if req.status == RequestStatus.PREEMPTED:
        return PAUSED[0] if req.num_host_tokens else PAUSED[1]
    if req.status == RequestStatus.RUNNING and req.num_new_tokens > 1:
        return "prefilling"
    return req.status.value


def request_row(req: Request, now: float) -> dict:
    """One request as the page shows it; its reader has (dry_at - now) * r - 1 tokens unread."""
    lead = req.dry_at - now
    return {
        "id": req.request_id,
        "state": request_state(req),
        "read_rate": req.read_rate,
        "ttft": req.record().ttft if req.started else None,
        "age": now - req.arrival_time,
        "output": req.num_output_tokens,
        "max_tokens": req.params.max_tokens,
        "preemptions": req.num_preemptions,
        "buffer_tokens": max(0, math.ceil(lead * req.read_rate - 1)) if req.started else 0,
        "buffer_s": lead if req.started else None,
    }


def burst_requests(body: dict, engine: Engine) -> list[tuple[list[int], SamplingParams]]:
    """The page's burst: {"prompt_len", "output_len", "read_rates": one per request}."""
    rates = body.get("read_rates")
    lengths = (body.get("prompt_len"), body.get("output_len"))
    if not isinstance(rates, list) or not 1 <= len(rates) <= MAX_BURST:
        raise ValueError(f"`read_rates` must list one rate per request, 1 to {MAX_BURST} of them")
    if not all(type(n) is int and n >= 1 for n in lengths):
        raise ValueError("`prompt_len` and `output_len` must be token counts >= 1")
    prompt_len, output_len = lengths
    if prompt_len + output_len > engine.max_model_len:
        raise ValueError(f"prompt_len + output_len must fit the context: {engine.max_model_len}")
    out = []
    for rate in rates:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, read_rate=rate)
        ids = [random.randrange(engine.config.vocab_size) for _ in range(prompt_len)]
        engine.check_prompt(ids, params)
        out.append((ids, params))
    return out


def live_page(handler) -> None:
    handler.send_bytes(200, page(), "text/html; charset=utf-8")


def engine_events(handler) -> None:
    """Snapshots of the engine, one server-sent event each, while the viewer stays."""
    handler.start_events()
    with handler.server.live.watching() as version:
        # on the engine thread, which this wakes: an idle one then publishes snapshots too
        handler.server.loop.inbox.put(handler.server.live.restart)
        with suppress(OSError):  # the viewer left
            while snapshot := handler.server.live.next(version):
                version = snapshot["version"]
                handler.sse(snapshot)


def engine_burst(handler) -> None:
    """The page's burst, sent from here: a browser holds only six connections to one server."""
    requests = burst_requests(handler.read_json(), handler.server.engine)
    queues = []  # nobody reads them: each is dropped with its finished request
    try:
        for ids, params in requests:
            request_id = f"burst-{uuid.uuid4().hex[:8]}"
            queues.append(handler.server.loop.submit([request_id], ids, [params], request_id))
    except HTTPError as e:  # overloaded: the rest are not sent
        log.warning("burst: %d of %d requests sent: %s", len(queues), len(requests), e)
    handler.send_json(200, {"submitted": len(queues), "requested": len(requests)})
