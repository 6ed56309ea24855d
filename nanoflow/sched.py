"""Requests and the scheduler: who runs in the next engine step, with how many tokens, and who waits.

A request waits, runs (its prompt in chunks, then one token per step), may be preempted, and
finishes. Each step the scheduler spends a budget of `max_num_batched_tokens`: decodes first (one
token each, so that running readers never stall behind a long prompt), then the chunks of prompts in
progress, then waiting requests while KV memory allows.

Two policies decide who that is:
- `fcfs`, the vLLM/SGLang default: admit in arrival order; when a running request cannot grow,
  preempt the newest by recompute (drop its KV, prefill it again later).
- `tokenflow` (DESIGN §6): every request has a reader with a buffer of unread tokens. Under stress
  (someone is waiting), requests whose buffers cover a switch are preempted (their KV goes to host
  memory, swap.py) so that newcomers start at once; each preempted request comes back, by load or
  recompute, whichever is estimated faster, before its reader runs dry.
"""

import dataclasses
import enum
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from .kv import KVPool
from .metrics import Reader, RequestRecord
from .swap import Swapper


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
        check(self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed",
              "a 64-bit integer or None")
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
    num_computed_tokens: int = 0  # tokens whose KV is in the device pool
    block_table: list[int] = field(default_factory=list)
    num_host_tokens: int = 0  # leading tokens whose KV is (or is on its way) in the host pool
    host_block_table: list[int] = field(default_factory=list)
    load_event: torch.cuda.Event | None = None  # the compute stream waits for it before running this request
    last_moved: float = float("-inf")  # when it was last preempted or resumed (tokenflow's anti-thrashing)
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

    @property
    def started(self) -> bool:
        return bool(self.token_times)

    def time_to_stall(self, now: float) -> float:
        """Seconds until the reader runs out of tokens (0 if it is waiting for one now)."""
        return self.reader.buffer(self.token_times, now) / self.read_rate

    def stream_text(self) -> str:
        """The output text that is safe to show now: a possible start of a stop string is held back."""
        if self.is_finished or not self.params.stop:
            return self.output_text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.output_text[:max(0, len(self.output_text) - hold)]


@dataclass
class TokenFlowConfig:
    """TokenFlow's constants (DESIGN §6); each appears in --help of the server and the bench."""

    interval: float = 1.5  # s between reschedules (Δt; the paper: 0.5-1.5 s; shorter thrashes at H200 scale, bench --simulate)
    mu: float = 2.0  # safety factor: a buffer must cover mu switches before its request is preempted
    hysteresis: float = 0.1  # running requests look 10% more urgent than they are (Andes' bonus), so pairs don't swap
    memory_reserve: float = 0.05  # share of device KV blocks left free for growth between reschedules
    write_through_below: float = 0.2  # write through once free device KV falls below this share (or someone waits)

    @classmethod
    def parse(cls, text: str) -> "TokenFlowConfig":
        """From "interval=1.5,mu=2" (the --tokenflow option of the server and the bench)."""
        fields = dict(kv.split("=", 1) for kv in text.split(",") if kv)
        unknown = fields.keys() - cls.__dataclass_fields__.keys()
        if unknown:
            raise ValueError(f"unknown TokenFlow constant(s) {sorted(unknown)}; known: {list(cls.__dataclass_fields__)}")
        return cls(**{k: float(v) for k, v in fields.items()})

    @classmethod
    def help(cls) -> str:
        return ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))


@dataclass
class StepRates:
    """What the engine has measured, for the estimates the policies need (EMA of recent steps)."""

    step_time: float = 0.05  # s per engine step
    prefill_rate: float = 2000.0  # prompt tokens/s when prefilling
    capacity: float = float("inf")  # output tokens/s the engine produces when it is busy (Γ)
    ema: float = 0.2

    def observe(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        self.step_time += self.ema * (seconds - self.step_time)
        if prefill_tokens > decode_tokens:
            self.prefill_rate += self.ema * (prefill_tokens / seconds - self.prefill_rate)
        elif decode_tokens:
            rate = decode_tokens / seconds
            self.capacity = rate if math.isinf(self.capacity) else self.capacity + self.ema * (rate - self.capacity)


class Scheduler:
    """Continuous batching with chunked prefill; preemption by eviction to host or by recompute."""

    def __init__(self, kv: KVPool, max_num_seqs: int, max_num_batched_tokens: int, clock,
                 policy: str = "tokenflow", swapper: Swapper | None = None, config: TokenFlowConfig | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv, self.swapper, self.clock, self.policy = kv, swapper, clock, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.config = config or TokenFlowConfig()
        self.rates = StepRates()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: fcfs preempts the newest
        self.counters: Counter[str] = Counter()
        self.last_rebalance = float("-inf")
        self.num_steps = 0
        self.force_preempt_every = 0  # testing only: preempt one running request every N steps...
        self.force_resume: str | None = None  # ...and bring it back by "load" or "recompute"

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, number of new tokens), decodes first."""
        now = self.clock()
        self.num_steps += 1
        if self.swapper:
            self.swapper.poll()  # finished copies give their blocks back
        self._forced_preemption()
        if self.policy == "tokenflow":
            self._rebalance(now)
        budget = self.max_num_batched_tokens
        preempted = False  # for lack of memory: then nobody new starts this step
        scheduled: dict[Request, int] = {}
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0 or req not in self.running:  # out of budget, or preempted for an older one
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.grow(req.block_table, req.num_computed_tokens + n):
                if self.kv.pending_free:  # evicted blocks come back once their copies are done: wait, don't evict more
                    self.swapper.complete_all()
                    continue
                victim = self._victim(now)
                budget += scheduled.pop(victim, 0)
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
        if not preempted:
            self._admit(scheduled, budget, now)
        return sorted(scheduled.items(), key=lambda item: item[1] > 1)

    # ------------------------------------------------------------ admission and resumption

    def _admit(self, scheduled: dict[Request, int], budget: int, now: float) -> None:
        """Start or resume waiting requests, most urgent first, while budget, seats and KV memory last."""
        for req in self._admission_order(now):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                return
            if self.policy == "tokenflow" and now - req.last_moved < self.config.interval:
                continue  # just preempted: it stays out for an interval, so that nobody swaps back and forth
            load = req.status == RequestStatus.PREEMPTED and req.num_host_tokens > 0 and self._resume_by_load(req)
            start = req.num_host_tokens if load else req.num_computed_tokens
            need = self.kv.blocks_needed(req.block_table, start + 1)
            if need > self.kv.num_free:
                return  # head-of-line: nobody overtakes the most urgent waiting request...
            if need > self.kv.num_free - self._reserve(req):
                continue  # ...except that a newcomer may not take the reserve, which others may
            self._resume(req, load)
            room = (len(req.block_table) + self.kv.num_free) * self.kv.block_size - req.num_computed_tokens
            n = min(req.num_tokens - req.num_computed_tokens, budget, room)
            self.kv.grow(req.block_table, req.num_computed_tokens + n)
            self.waiting.remove(req)
            req.status, req.last_moved = RequestStatus.RUNNING, now
            self.running.append(req)
            scheduled[req] = n
            budget -= n

    def _reserve(self, req: Request) -> int:
        """Blocks a newcomer must leave free under tokenflow, so that running requests can grow without preemption."""
        if self.policy == "fcfs" or req.status != RequestStatus.WAITING or not self.running:
            return 0
        return int(self.config.memory_reserve * self.kv.num_blocks)

    def _admission_order(self, now: float) -> list[Request]:
        if self.policy == "fcfs":
            return list(self.waiting)
        return sorted(self.waiting, key=lambda r: self._urgency(r, now))

    def _resume(self, req: Request, load: bool) -> None:
        """Bring back a preempted request's KV by load, or leave it to be recomputed from its tokens."""
        if req.status != RequestStatus.PREEMPTED:
            return
        if load:
            self.swapper.load(req)
            self.counters["resumes_load"] += 1
            return
        if self.swapper:
            self.swapper.forget(req)
        self.counters["resumes_recompute"] += 1

    def _resume_by_load(self, req: Request) -> bool:
        if self.force_resume:
            return self.force_resume == "load"
        if self.policy == "fcfs":
            return False
        return self.swapper.load_time(req) <= req.num_host_tokens / self.rates.prefill_rate

    # ------------------------------------------------------------ preemption

    def preempt(self, req: Request) -> None:
        """Take req off the device: evict its KV to host (tokenflow) or drop it for recompute (fcfs)."""
        self.running.remove(req)
        if not (self._uses_host() and self.swapper.evict(req)):
            if self.swapper:
                self.swapper.release(req)
            else:
                self.kv.free(req.block_table)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        req.status, req.last_moved = RequestStatus.PREEMPTED, self.clock()
        self.waiting.appendleft(req)

    def _under_pressure(self) -> bool:
        """Could a preemption come soon? Then write-through pays: someone waits, or (when copies run beside
        compute) the device pool is nearly full. Synchronous copies (CPU) steal compute, so only the former."""
        if self.waiting:
            return True
        return self.swapper.async_copies and self.kv.num_free < self.config.write_through_below * self.kv.num_blocks

    def _uses_host(self) -> bool:
        """tokenflow evicts to host memory when there is any; fcfs recomputes (tests may force either)."""
        if self.swapper is None or self.force_resume == "recompute":
            return False
        return self.policy == "tokenflow" or self.force_resume == "load"

    def _victim(self, now: float) -> Request:
        """fcfs: the newest. tokenflow: the request whose reader has the most time left, if any can wait."""
        if self.policy == "tokenflow":
            can_wait = [r for r in self.running if self._preemptable(r, now)]
            if can_wait:
                return max(can_wait, key=lambda r: r.time_to_stall(now))
        return self.running[-1]

    def _forced_preemption(self) -> None:
        if self.force_preempt_every and len(self.running) > 1 and self.num_steps % self.force_preempt_every == 0:
            self.preempt(self.running[self.num_steps // self.force_preempt_every % len(self.running)])

    # ------------------------------------------------------------ tokenflow

    def _urgency(self, req: Request, now: float) -> float:
        """Sort key, most urgent first: not started yet (by arrival), then least time until the reader stalls."""
        if not req.started:
            return -1e12 + req.arrival_time
        bonus = 1 - self.config.hysteresis if req.status == RequestStatus.RUNNING else 1
        return req.time_to_stall(now) * bonus

    def _switch_time(self, req: Request) -> float:
        """Estimated seconds to take req off the device and bring it back, plus one reschedule interval."""
        bs, bytes_per_block = self.kv.block_size, self.kv.bytes_per_block
        evict = (math.ceil(req.num_computed_tokens / bs) - req.num_host_tokens // bs) * bytes_per_block
        load = math.ceil(req.num_computed_tokens / bs) * bytes_per_block
        io = self.swapper.backlog() + (evict + load) / self.swapper.bandwidth if self.swapper else float("inf")
        recompute = req.num_tokens / self.rates.prefill_rate
        return min(io, recompute) + self.config.interval + self.rates.step_time

    def _preemptable(self, req: Request, now: float) -> bool:
        """Its buffer covers mu switches, and it has not moved within the last interval."""
        return (req.started and now - req.last_moved >= self.config.interval
                and req.time_to_stall(now) >= self.config.mu * self._switch_time(req))

    def _rebalance(self, now: float) -> None:
        """Every interval (or at once when a newcomer waits): preempt what the most urgent requests need."""
        newcomer = any(not r.started and r.status == RequestStatus.WAITING for r in self.waiting)
        if not self.waiting or (now - self.last_rebalance < self.config.interval and not newcomer):
            return
        self.last_rebalance = now
        members = [r for r in self.running + list(self.waiting) if r.started or r.status == RequestStatus.RUNNING]
        demand = sum(r.read_rate for r in members)
        for r in self.waiting:  # newcomers join the working set while total reading demand stays within capacity
            if not r.started and r.status == RequestStatus.WAITING and demand + r.read_rate <= self.rates.capacity:
                members.append(r)
                demand += r.read_rate
        keep = self._greedy_fill(sorted(members, key=lambda r: self._urgency(r, now)))
        for r in [r for r in reversed(self.running) if r not in keep and self._preemptable(r, now)]:
            self.preempt(r)

    def _greedy_fill(self, by_urgency: list[Request]) -> set[Request]:
        """The most urgent requests whose KV fits in device memory (less a reserve) and in the seats."""
        room = self.kv.num_blocks * (1 - self.config.memory_reserve)
        keep: set[Request] = set()
        for r in by_urgency[:self.max_num_seqs]:
            need = math.ceil((r.num_tokens + 1) / self.kv.block_size)
            if need > room:
                break
            keep.add(r)
            room -= need
        return keep

    # ------------------------------------------------------------ the end of a request

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out of the queues for good and give back its blocks in both pools."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.swapper:
            self.swapper.release(req)
        else:
            self.kv.free(req.block_table)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def after_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Learn from the step just run; write newly filled blocks through to host, largest buffers first."""
        self.rates.observe(seconds, prefill_tokens, decode_tokens)
        if not self._uses_host() or not self._under_pressure():
            return
        now = self.clock()
        by_buffer = sorted(self.running, key=lambda r: -r.time_to_stall(now))
        max_blocks = int(self.rates.step_time * self.swapper.bandwidth / self.kv.bytes_per_block)
        self.swapper.write_through(by_buffer, max(1, max_blocks))


POLICIES = ("tokenflow", "fcfs")
