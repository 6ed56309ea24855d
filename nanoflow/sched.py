"""The scheduler: who runs in the next engine step, with how many tokens, who waits.

A step spends a budget of `max_num_batched_tokens`: decodes first (no reader stalls behind a
prompt), then prompt chunks, then waiting requests while memory lasts. `Scheduler` is the mechanism
(queues, blocks, swap, the budget); a `Policy` (policies.py: FCFS, TokenFlow) picks who runs and who
is preempted, at the points its interface names. It may import kv, request and swap.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from .kv import KVPool, cdiv
from .request import Request, RequestStatus, loaded
from .swap import Swapper

ESTIMATE_CLIP_TOKENS = 4096  # estimates count at most this many of max_tokens (SGLang's clip)
DRY_SOON_HORIZON_S = 1.5  # the buffer signal's horizon when the policy has no interval of its own


@dataclass
class StepRates:
    """What the engine has measured, for the policies' estimates (EMAs of recent steps)."""

    prefill_rate: float = 2000.0  # prompt tokens/s on mostly-prefill steps (a guess until measured)
    # EMAs of (batch, seconds, batch^2, batch x seconds) of decode steps (docs/scheduling.md)
    decode_moments: tuple[float, float, float, float] = (1.0, 0.05, 1.0, 0.05)
    mixed_overrun: float = 0.0  # how far the last step of decodes and a chunk ran past its estimate
    ema: float = 0.2
    seen: Counter = field(default_factory=Counter)

    def observe(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        if prefill_tokens / self.prefill_rate > self.decode_time(decode_tokens):  # prompts dominate
            self.prefill_rate = self._ema("prefill", self.prefill_rate, prefill_tokens / seconds)
        elif prefill_tokens and decode_tokens and self.seen["prefill"]:  # a chunk beside decodes
            overrun = seconds - self.decode_time(decode_tokens) - prefill_tokens / self.prefill_rate
            self.mixed_overrun = max(0.0, overrun)  # the next such step runs alike (a chain)
        if decode_tokens and (not prefill_tokens or not self.seen["decode"]):
            moments = (decode_tokens, seconds, decode_tokens**2, decode_tokens * seconds)
            self.decode_moments = self._ema("decode", self.decode_moments, moments)

    def decode_time(self, batch: float) -> float:
        """Seconds of a decode step of `batch` requests: a least-squares line over recent steps."""
        b, t, bb, bt = self.decode_moments
        spread = bb - b * b
        slope = max(0.0, (bt - b * t) / spread) if spread > 1.0 else 0.0
        return t + slope * max(0.0, batch - b)  # fewer: as slow (a step reads all weights)

    def _ema(self, key: str, old, new):
        """The first measurement replaces the guess; later ones move the average."""
        self.seen[key] += 1
        if self.seen[key] == 1:
            return new
        if isinstance(new, tuple):
            return tuple(o + self.ema * (n - o) for o, n in zip(old, new))
        return old + self.ema * (new - old)


class Policy(Protocol):
    """What a policy decides, and when the scheduler asks (each step, in this order)."""

    evicts_to_host: bool  # a preempted request's KV goes to host (else it is recomputed)
    horizon: float  # s ahead the buffer signal counts readers about to run dry

    def preemptions(self, s: Scheduler, now: float) -> list[Request]:
        """Running requests to take off the device before this step."""

    def token_budget(self, s: Scheduler, now: float) -> int:
        """Tokens this step may compute (at most max_num_batched_tokens)."""

    def victim(self, s: Scheduler, now: float) -> Request:
        """The running request to preempt when memory runs out mid-step."""

    def retracted(self, s: Scheduler) -> None:
        """Memory ran out this step (after the victims left)."""

    def admit(self, s: Scheduler, scheduled: dict[Request, int], budget: int, now: float) -> None:
        """Start waiting requests with `s.start` while budget and memory allow."""

    def resume_by_load(self, s: Scheduler, req: Request) -> bool:
        """Resume a preempted req by loading its KV from host (else by recomputing it)."""

    def after_step(self, s: Scheduler) -> None:
        """The step ran: learn from it, start copies."""


class Scheduler:
    """The mechanism: queues, KV blocks, swap and each step's token budget; a policy decides."""

    def __init__(
        self,
        kv: KVPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock,
        policy: Policy,
        swapper: Swapper | None = None,
        enable_prefix_caching: bool = True,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv = kv
        self.swapper = swapper
        self.clock = clock
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rates = StepRates()
        self.waiting: deque[Request] = deque()  # the preempted first, then newcomers by arrival
        self.running: list[Request] = []  # in admission order
        self.counters: Counter[str] = Counter()
        self.last_arrival = float("-inf")

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.last_arrival = self.clock()

    def wait_to_admit(
        self, queued: int, max_waiting: int, prompt_tokens: int, max_tokens: int, bound_s: float
    ) -> float | None:
        """None while at most `max_waiting` of `queued` requests (no token yet) cannot start in
        `bound_s` at the measured prefill rate; else the seconds decoding needs for the excess."""
        startable = int(bound_s * self.rates.prefill_rate / max(1, prompt_tokens))
        excess = queued - startable - max_waiting + 1
        if excess <= 0:
            return None
        return excess * max_tokens * self.step_time() / max(1, len(self.running))

    def buffer_signal(self) -> dict[str, float]:
        """What a router may score on (docs/scheduling.md, "The buffer signal")."""
        now = self.clock()
        readers = self.running + list(self.waiting)
        started = [r for r in readers if r.started]
        demand = sum(r.read_rate for r in readers)
        capacity = self.capacity(len(started), self.lifetime_size(started))
        return {
            "reader_demand_tokens_per_second": demand,
            "capacity_tokens_per_second": capacity,
            "past_capacity": int(demand > capacity),
            "readers_dry_soon": sum(r.dry_at < now + self.policy.horizon for r in started),
        }

    def capacity(self, n: int, size: float, share: float = 1.0) -> float:
        """`share` of the measured tokens/s at the batch memory holds, were n requests of `size`
        tokens in all to run (TokenFlow's working set takes a share; the buffer signal all)."""
        batch = self.batch_that_fits(n, size)
        return share * batch / self.rates.decode_time(batch)

    def batch_that_fits(self, n: int, size: float) -> float:
        """Requests the device holds, were n requests of `size` tokens in all (lifetime_size)."""
        if not n:
            return float(self.max_num_seqs)
        return min(self.max_num_seqs, self.kv.num_blocks * self.kv.block_size * n / size)

    def lifetime_size(self, reqs: Iterable[Request], start: float = 0.0) -> float:
        """KV tokens reqs hold on average over the rest of their lives, summed onto start:
        each its tokens and half those it may still add (at most ESTIMATE_CLIP_TOKENS)."""
        clip = ESTIMATE_CLIP_TOKENS
        return sum((r.num_tokens + min(r.num_tokens_left, clip) / 2 for r in reqs), start)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, number of new tokens), decodes first."""
        now = self.clock()
        if self.swapper:
            self.swapper.poll()  # finished copies give their blocks back
        for req in self.policy.preemptions(self, now):
            self.preempt(req)
        scheduled, budget, short = self._schedule_running(now)
        if self.waiting and not short:  # memory short for the running: no room for newcomers
            self.policy.admit(self, scheduled, budget, now)
        if self.swapper:
            self.swapper.demote()  # the cached blocks taken this step keep their KV on host
        # decodes first; a request started without room for a token waits for the next step
        items = scheduled.items()
        return [(r, n) for r, n in items if n == 1] + [(r, n) for r, n in items if n > 1]

    def _schedule_running(self, now: float) -> tuple[dict[Request, int], int, bool]:
        """Tokens for the running requests; the budget left; whether memory ran short."""
        budget = self.policy.token_budget(self, now)
        scheduled = {}
        short = False
        decodes_first = sorted(self.running, key=lambda r: r.num_new_tokens != 1)
        for req in decodes_first:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or not loaded(req):
                continue  # preempted for an older one, or its KV is on its way
            n = min(req.num_new_tokens, budget)
            if req.num_computed_tokens + n <= len(req.block_table) * self.kv.block_size:
                scheduled[req] = n  # its last block has room: most decodes
                budget -= n
                continue
            while not self.kv.grow(req.block_table, req.num_computed_tokens + n):
                if self.kv.pending_free:  # evicted blocks return once copied: wait, evict no more
                    self.swapper.complete_all()
                    continue
                victim = self.policy.victim(self, now)
                budget += scheduled.pop(victim, 0)
                self.preempt(victim)
                self.policy.retracted(self)
                short = True
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
        return scheduled, budget, short

    def step_time(self) -> float:
        return self.rates.decode_time(len(self.running))

    def full(self, budget: int) -> bool:
        return budget == 0 or len(self.running) >= self.max_num_seqs

    def start(self, req: Request, scheduled: dict[Request, int], budget: int, now: float) -> int:
        """Move req to running and schedule its first tokens unless its KV is on its way."""
        if req.status == RequestStatus.PREEMPTED:
            self._resume(req)
        if not req.block_table and self.enable_prefix_caching:
            self._match_prefix(req)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        req.last_moved = now
        self.running.append(req)
        if not loaded(req):
            return budget
        room = (len(req.block_table) + self.kv.num_free) * self.kv.block_size
        n = min(req.num_new_tokens, budget, room - req.num_computed_tokens)
        self.kv.grow(req.block_table, req.num_computed_tokens + n)
        scheduled[req] = n
        return budget - n

    def blocks_to_start(self, req: Request) -> int:
        """Device blocks req needs to start: its loaded KV, or its next token to compute."""
        start = req.num_host_tokens if self.resumes_by_load(req) else req.num_computed_tokens
        return self.kv.blocks_needed(req.block_table, start + 1)

    def blocks_to_decode(self, req: Request) -> int:
        return self.kv.blocks_needed(req.block_table, req.num_tokens + 1)

    def resumes_by_load(self, req: Request) -> bool:
        return (
            req.status == RequestStatus.PREEMPTED
            and req.num_host_tokens > 0
            and self.policy.resume_by_load(self, req)
        )

    def _resume(self, req: Request) -> None:
        if self.resumes_by_load(req):
            self.swapper.load(req)
            self.counters["resumes_load"] += 1
            return
        if self.swapper:
            self.swapper.forget(req)
        self.counters["resumes_recompute"] += 1

    def _match_prefix(self, req: Request) -> None:
        """Skip req's longest cached prefix (device, then host); its last token is computed."""
        bs = self.kv.block_size
        hashes = self.hashes(req, (req.num_tokens - 1) // bs)
        blocks = self.kv.match_prefix(hashes)
        req.block_table = blocks
        req.num_cached_blocks = len(blocks)
        req.num_computed_tokens = len(blocks) * bs
        self.counters["prefix_queried_tokens"] += req.num_tokens
        self.counters["prefix_hit_tokens"] += req.num_computed_tokens
        if self.swapper:
            n = self.swapper.load_prefix(req, hashes[len(blocks) :], self.load_beats_recompute)
            self.counters["prefix_host_hit_tokens"] += n * bs

    def load_beats_recompute(self, num_tokens: int) -> bool:
        load = self.swapper.copy_done_in(cdiv(num_tokens, self.kv.block_size))
        return load <= num_tokens / self.rates.prefill_rate

    def hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The chained hashes of req's first num_blocks full blocks (computed once per block)."""
        bs = self.kv.block_size
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash((parent, tuple(req.token_ids[i * bs : (i + 1) * bs]))))
        return req.block_hashes[:num_blocks]

    def _cache_full_blocks(self, req: Request) -> None:
        """Name the blocks req has filled since the last step: later prompts can share them."""
        full = self.kv.num_full(req.block_table, req.num_computed_tokens)
        if full > req.num_cached_blocks:
            start = req.num_cached_blocks
            self.kv.cache_blocks(req.block_table[start:full], self.hashes(req, full)[start:])
            req.num_cached_blocks = full

    def _release(self, req: Request, to_host: bool) -> None:
        """Dequeue req; its KV goes to host (if to_host and it fits) or is dropped. Its filled
        blocks are named first (those of its last step too): they stay cached for others."""
        if self.enable_prefix_caching and loaded(req):
            self._cache_full_blocks(req)
        (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
        if to_host and self.swapper and self.swapper.evict(req):
            return
        if self.swapper:
            self.swapper.release(req)
        else:
            self.kv.free(req.block_table)

    def preempt(self, req: Request) -> None:
        self._release(req, to_host=self.policy.evicts_to_host)
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        req.status = RequestStatus.PREEMPTED
        req.last_moved = self.clock()
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status != RequestStatus.FINISHED:
            self._release(req, to_host=False)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def after_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Learn from the step just run; the policy may copy freshly filled blocks to host."""
        self.rates.observe(seconds, prefill_tokens, decode_tokens)
        if self.enable_prefix_caching:
            bs = self.kv.block_size
            for req in self.running:  # blocks being loaded are not shared yet
                if req.num_computed_tokens // bs > req.num_cached_blocks and loaded(req):
                    self._cache_full_blocks(req)  # a block filled: ~1 step in block_size
        self.policy.after_step(self)
