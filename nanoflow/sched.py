"""Requests and the scheduler: who runs in the next engine step, and with how many tokens.

A request waits, runs (its prompt in chunks, then one token per step), may be preempted when KV
memory runs out, and finishes. Each step the scheduler spends a budget of `max_num_batched_tokens`:
decodes first (one token each, so running readers never stall behind a long prompt), then the
chunks of prompts in progress, then new requests in arrival order while KV memory allows. When a
running request cannot grow, the newest running request is preempted by recompute: its blocks are
freed and it goes back to the front of the queue to be prefilled again, prompt and output together.
"""

import enum
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from .kv import KVPool
from .metrics import Reader, RequestRecord


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and defaults)."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    read_rate: float | None = None  # tokens/s this request's reader reads; None = the engine's default

    def __post_init__(self):
        def check(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return (is_int(x) or isinstance(x, float)) and math.isfinite(x)

        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        check(is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "-1 (off) or an integer >= 1")
        check(self.seed is None or is_int(self.seed), "seed", "an integer or None")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        check(self.read_rate is None or (is_num(self.read_rate) and self.read_rate > 0), "read_rate",
              "a number > 0 (tokens/s) or None")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        check(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops), "stop",
              "a non-empty string or a list of them")
        self.stop = stops


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its reader still reading what it has
    FINISHED = "finished"


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation: its tokens, how many have KV computed, and the KV blocks that hold them."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_request_counter)}")
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    output_text: str = ""
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    read_rate: float = 8.0  # tokens/s, resolved by the engine (params.read_rate, clamped)
    token_times: list[float] = field(default_factory=list)  # when each output token was generated

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.reader = Reader(self.read_rate)

    def record(self) -> RequestRecord:
        return RequestRecord(self.arrival_time, self.token_times, self.read_rate)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def stream_text(self) -> str:
        """The output text that is safe to show now: a possible start of a stop string is held back."""
        if self.is_finished or not self.params.stop:
            return self.output_text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.output_text[:max(0, len(self.output_text) - hold)]


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, number of new tokens this step), decodes first
    preempted: list[Request]


class Scheduler:
    """FCFS with chunked prefill and preemption by recompute (the vLLM/SGLang default)."""

    def __init__(self, kv: KVPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.counters: Counter[str] = Counter()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted: list[Request] = []
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0 or req not in self.running:  # out of budget, or preempted for an older one
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.grow(req.block_table, req.num_computed_tokens + n):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self.preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
        if not preempted:
            budget = self._admit(scheduled, budget)
        order = sorted(scheduled.items(), key=lambda item: item[1] > 1)  # decodes first
        return SchedulerOutput(order, preempted)

    def _admit(self, scheduled: dict[Request, int], budget: int) -> int:
        """Start waiting requests in arrival order while budget, seats and KV memory last."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.grow(req.block_table, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            if req.status == RequestStatus.PREEMPTED:
                self.counters["resumes_recompute"] += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req] = n
            budget -= n
        return budget

    def preempt(self, req: Request) -> None:
        """Recompute later: drop the KV, keep the tokens, go back to the head of the queue."""
        self.running.remove(req)
        self.kv.free(req.block_table)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out of the queues for good and give back its KV blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.block_table)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
