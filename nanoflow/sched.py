"""Requests and the scheduler: who runs in the next engine step, with how many tokens, who waits.

Each step spends a budget of `max_num_batched_tokens`: decodes first (so that readers never stall
behind a long prompt), then prompt chunks, then waiting requests while memory allows. `Scheduler`
is the mechanism (queues, KV blocks, swap, the budget); a policy decides who runs and who is
preempted: `FCFS` (SGLang's default) or `TokenFlow` (buffer-aware), both in docs/scheduling.md.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .kv import KVPool, cdiv
from .metrics import RequestRecord, read_times
from .swap import Swapper


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and defaults)."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = all tokens
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # ...times the number of times it is there
    repetition_penalty: float = 1.0  # divides positive logits of tokens seen: 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    stop_token_ids: list[int] | None = None  # tokens that end the output like EOS does
    logprobs: int | None = None  # k: each token's logprob and the k likeliest alternatives
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    read_rate: float | None = None  # tokens/s its reader reads; None = the engine's default
    json_schema: dict | None = None  # the output must be JSON valid against it (grammar.py)

    def __post_init__(self):
        def check(name: str, ok: bool, rule: str):
            if not ok:
                got = getattr(self, name)
                raise ValueError(f"SamplingParams.{name} must be {rule}, got {got!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return (is_int(x) or isinstance(x, float)) and math.isfinite(x)

        check("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1")
        check("temperature", is_num(self.temperature) and self.temperature >= 0, "a number >= 0")
        check("top_p", is_num(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        check("top_k", is_int(self.top_k) and self.top_k >= -1, "-1 or 0 (off) or an integer >= 1")
        check("min_p", is_num(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(name, is_num(value) and -2 <= value <= 2, "a number in [-2, 2]")
        penalty = self.repetition_penalty
        check("repetition_penalty", is_num(penalty) and penalty > 0, "a number > 0")
        least = self.min_tokens
        check(
            "min_tokens",
            is_int(least) and 0 <= least <= self.max_tokens,
            "an integer in [0, max_tokens]",
        )
        top = self.logprobs
        check(
            "logprobs",
            top is None or (is_int(top) and 0 <= top <= MAX_LOGPROBS),
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )
        self.stop_token_ids = self.stop_token_ids or []
        ids = self.stop_token_ids
        check(
            "stop_token_ids",
            isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids),
            "a list of token ids",
        )
        bias = self.logit_bias or {}
        valid = lambda k, v: str(k).isdigit() and is_num(v) and abs(v) <= 100  # noqa: E731
        check(
            "logit_bias",
            isinstance(bias, dict) and all(valid(k, v) for k, v in bias.items()),
            "a map from token id to a number in [-100, 100]",
        )
        self.logit_bias = {int(k): float(v) for k, v in bias.items()}  # JSON keys are strings
        seed = self.seed
        check(
            "seed",
            seed is None or (is_int(seed) and -(2**63) <= seed < 2**64),
            "a 64-bit integer or None",
        )
        check("ignore_eos", isinstance(self.ignore_eos, bool), "a bool")
        check(
            "json_schema",
            self.json_schema is None or isinstance(self.json_schema, dict),
            "a JSON schema (a dict) or None",
        )
        rate = self.read_rate
        check(
            "read_rate",
            rate is None or (is_num(rate) and rate > 0),
            "a number > 0 (tokens/s) or None",
        )
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        check(
            "stop",
            isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
            "a non-empty string or a list of them",
        )
        self.stop = stops


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its reader still reading what it has
    FINISHED = "finished"


WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


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
    block_hashes: list[int] = field(default_factory=list)  # of its full blocks (kv.py), chained
    num_cached_blocks: int = 0  # leading blocks of block_table named in the pool's prefix cache
    num_host_tokens: int = 0  # leading tokens whose KV is (or is on its way) in the host pool
    host_block_table: list[int] = field(default_factory=list)
    load_event: torch.cuda.Event | None = None  # its load: the compute stream waits for it
    last_moved: float = float("-inf")  # last preempted or resumed (tokenflow's anti-thrashing)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | None = None  # the stop string that ended it, if one did
    output_text: str = ""
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    read_rate: float = 8.0  # tokens/s, resolved by the engine (params.read_rate, clamped)
    token_times: list[float] = field(default_factory=list)  # when each output token was generated
    logprobs: list = field(default_factory=list)  # per output token: Engine._record_logprobs
    matcher: object = None  # its grammar's state, advanced by each output token (grammar.py)
    # when its reader runs out of tokens (docs/scheduling.md); earlier than now if it stalls already
    dry_at: float = field(init=False)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        reads = read_times(self.token_times, self.read_rate)
        self.dry_at = reads[-1] + 1.0 / self.read_rate if reads else self.arrival_time

    def append(self, token: int, now: float) -> None:
        """A token generated now: its reader reads it at once, or when done with the one before."""
        self.token_ids.append(token)
        self.token_times.append(now)
        self.dry_at = max(now, self.dry_at) + 1.0 / self.read_rate

    def record(self) -> RequestRecord:
        return RequestRecord(self.arrival_time, self.token_times, self.read_rate)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_new_tokens(self) -> int:  # tokens whose KV is still to compute (1 while decoding)
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens_left(self) -> int:  # output tokens it may still generate
        return self.params.max_tokens - len(self.token_ids) + len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def started(self) -> bool:
        return bool(self.token_times)


@dataclass
class StepRates:
    """What the engine has measured, for the policies' estimates (EMAs of recent steps)."""

    prefill_rate: float = 2000.0  # prompt tokens/s on mostly-prefill steps (a guess until measured)
    # EMAs of (batch, seconds, batch^2, batch x seconds) of decode steps (docs/scheduling.md)
    decode_moments: tuple[float, float, float, float] = (1.0, 0.05, 1.0, 0.05)
    ema: float = 0.2
    seen: Counter = field(default_factory=Counter)

    def observe(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        if prefill_tokens / self.prefill_rate > self.decode_time(decode_tokens):  # prompts dominate
            self.prefill_rate = self._ema("prefill", self.prefill_rate, prefill_tokens / seconds)
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


class Scheduler:
    """The mechanism: queues, KV blocks, swap and each step's token budget; a policy decides."""

    def __init__(
        self,
        kv: KVPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        clock,
        policy: str | Policy = "tokenflow",
        swapper: Swapper | None = None,
        config: TokenFlowConfig | None = None,
        enable_prefix_caching: bool = True,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv, self.swapper, self.clock = kv, swapper, clock
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = make_policy(policy, config) if isinstance(policy, str) else policy
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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
        now, readers = self.clock(), self.running + list(self.waiting)
        started = [r for r in readers if r.started]
        # FCFS has no interval of its own: TokenFlow's default
        horizon = getattr(self.policy, "config", TokenFlowConfig).interval
        demand = sum(r.read_rate for r in readers)
        capacity = self.policy.capacity(self, len(started), self.policy.lifetime_size(started))
        return {
            "reader_demand_tokens_per_second": demand,
            "capacity_tokens_per_second": capacity,
            "past_capacity": int(demand > capacity),
            "readers_dry_soon": sum(r.dry_at < now + horizon for r in started),
        }

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, number of new tokens), decodes first."""
        now = self.clock()
        if self.swapper:
            self.swapper.poll()  # finished copies give their blocks back
        for req in self.policy.preemptions(self, now):
            self.preempt(req)
        scheduled, budget, short = self._schedule_running(now)
        # a pool too short for the running requests has no room for anyone new
        if self.waiting and not short:
            self.policy.admit(self, scheduled, budget, now)
        if self.swapper:
            self.swapper.demote()  # the cached blocks taken this step keep their KV on host
        # decodes first; a request started without room for a token waits for the next step
        items = scheduled.items()
        return [(r, n) for r, n in items if n == 1] + [(r, n) for r, n in items if n > 1]

    def _schedule_running(self, now: float) -> tuple[dict[Request, int], int, bool]:
        """Tokens for the running requests; the budget left; whether memory ran short."""
        budget = self.policy.token_budget(self, now)
        scheduled, short = {}, False
        # runs once per request per step: attributes, no properties, no min(); decodes, then chunks
        order = sorted(self.running, key=lambda r: len(r.token_ids) - r.num_computed_tokens != 1)
        bs, running = self.kv.block_size, RequestStatus.RUNNING
        for req in order:
            if budget == 0:
                break
            if req.status is not running or not loaded(req):
                continue  # preempted for an older one, or its KV is on its way
            n = len(req.token_ids) - req.num_computed_tokens
            n = n if n < budget else budget
            if req.num_computed_tokens + n <= len(req.block_table) * bs:
                scheduled[req] = n  # its last block has room: most decodes
                budget -= n
                continue
            while not self.kv.grow(req.block_table, req.num_computed_tokens + n):
                if self.kv.pending_free:
                    # evicted blocks come back once their copies are done: wait, don't evict more
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
        req.status, req.last_moved = RequestStatus.RUNNING, now
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
        req.block_table, req.num_cached_blocks = blocks, len(blocks)
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
        req.num_computed_tokens = req.num_cached_blocks = 0
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        req.status, req.last_moved = RequestStatus.PREEMPTED, self.clock()
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status != RequestStatus.FINISHED:
            self._release(req, to_host=False)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def after_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Learn from the step just run; the policy may copy freshly filled blocks to host."""
        self.rates.observe(seconds, prefill_tokens, decode_tokens)
        if self.enable_prefix_caching:
            bs = self.kv.block_size
            for req in self.running:  # blocks being loaded are not shared yet
                if req.num_computed_tokens // bs > req.num_cached_blocks and loaded(req):
                    self._cache_full_blocks(req)  # a block filled: ~1 step in block_size
        self.policy.after_step(self)


def loaded(req: Request) -> bool:
    """Is req's KV on the device? A resumed request joins the batch once its own load is done."""
    return req.load_event is None or req.load_event.query()


# ------------------------------------------------------------------------ the policies


@dataclass
class FCFSConfig:
    """SGLang's admission estimate: `new_token_ratio` of each request's max_tokens is kept free."""

    init_new_token_ratio: float = 0.7  # SGLang's default start
    min_new_token_ratio: float = 0.1  # ...and its floor (SGLang: 0.14 of the start)
    decay_steps: int = 600  # steps to decay from start to floor (SGLang's default)
    retract_decode_steps: int = 20  # a retraction keeps room for this many more tokens of each
    clip_max_new_tokens: int = 4096  # estimates count at most this many of max_tokens (SGLang's)


class FCFS:
    """The baseline (SGLang's default, docs/scheduling.md), and the interface of every policy."""

    evicts_to_host = False

    def __init__(self, config: FCFSConfig | None = None):
        self.fcfs = config or FCFSConfig()
        self.new_token_ratio = self.fcfs.init_new_token_ratio

    def preemptions(self, s: Scheduler, now: float) -> list[Request]:
        return []

    def token_budget(self, s: Scheduler, now: float) -> int:
        return s.max_num_batched_tokens

    def admit(self, s: Scheduler, scheduled: dict[Request, int], budget: int, now: float) -> None:
        """Waiting requests in order while the estimate says memory lasts (a misfit stops it)."""
        reserved = None  # summed over the running requests only when someone might fit
        seats = max(0, s.max_num_seqs - len(s.running))
        queue = list(itertools.islice(self.admission_queue(s, now), seats))  # start() edits it
        for req in queue:
            if s.full(budget):
                return
            need = self.future_tokens(s, req)
            free = s.kv.num_free * s.kv.block_size
            if need > free:
                return
            if reserved is None:
                reserved = sum(self.future_tokens(s, r) for r in s.running)
            if need > free - reserved:
                return
            budget = s.start(req, scheduled, budget, now)
            reserved += self.future_tokens(s, req)  # less what it holds now

    def admission_queue(self, s: Scheduler, now: float) -> Iterable[Request]:
        return iter(s.waiting)

    def future_tokens(self, s: Scheduler, req: Request) -> int:
        """KV tokens kept free for req: its known tokens, a share of the output it may add."""
        left = min(req.num_tokens_left, self.fcfs.clip_max_new_tokens)
        return s.blocks_to_decode(req) * s.kv.block_size + int(left * self.new_token_ratio)

    def capacity(self, s: Scheduler, n: int, size: float, share: float = 1.0) -> float:
        """`share` of the engine's measured tokens/s at the batch its memory holds (TokenFlow's
        working set takes capacity_share of it; the buffer signal reports all of it)."""
        batch = self.batch_that_fits(s, n, size)
        return share * batch / s.rates.decode_time(batch)

    def batch_that_fits(self, s: Scheduler, n: int, size: float) -> float:
        """Requests the device holds, were n requests of `size` tokens in all (lifetime_size)."""
        if not n:
            return float(s.max_num_seqs)
        return min(s.max_num_seqs, s.kv.num_blocks * s.kv.block_size * n / size)

    def lifetime_size(self, reqs: Iterable[Request], start: float = 0.0) -> float:
        """KV tokens reqs hold on average over the rest of their lives, summed onto start: each its
        num_tokens + num_tokens_left / 2 (clipped), inlined: a rebalance sums over 1,000s."""
        clip = self.fcfs.clip_max_new_tokens
        return sum(
            (
                len(r.token_ids)
                + min(r.params.max_tokens + len(r.prompt_token_ids) - len(r.token_ids), clip) / 2
                for r in reqs
            ),
            start,
        )

    def victim(self, s: Scheduler, now: float) -> Request:
        """SGLang's order: the least output, then the longest prompt (the cheapest to redo)."""
        return min(s.running, key=lambda r: (r.num_output_tokens, -len(r.prompt_token_ids)))

    def retracted(self, s: Scheduler) -> None:
        """Memory ran out: the estimate was too kind; restart it from what the survivors need."""
        decoded = sum(r.num_output_tokens for r in s.running)
        wanted = sum(r.params.max_tokens for r in s.running)
        if wanted:
            kept = decoded + self.fcfs.retract_decode_steps * len(s.running)
            self.new_token_ratio = min(1.0, kept / wanted)

    def resume_by_load(self, s: Scheduler, req: Request) -> bool:
        return False

    def after_step(self, s: Scheduler) -> None:
        fcfs = self.fcfs
        step = (fcfs.init_new_token_ratio - fcfs.min_new_token_ratio) / fcfs.decay_steps
        self.new_token_ratio = max(self.new_token_ratio - step, fcfs.min_new_token_ratio)


@dataclass
class TokenFlowConfig:
    """TokenFlow's constants (docs/scheduling.md), in --help of the server and the bench."""

    interval: float = 1.5  # s between reschedules (Δt; the paper: 0.5-1.5 s)
    mu: float = 2.0  # a buffer must cover mu switches (and an interval) to be preempted
    capacity_share: float = 0.8  # of the measured tokens/s readers may ask: switches cost the rest
    hysteresis: float = 0.1  # running requests look this much more urgent (Andes): no ping-pong
    write_through_below: float = 0.2  # share of free device KV under which to write through
    stall_weight: float = 1.0  # a reader's second of stall against a newcomer's second of wait

    @classmethod
    def parse(cls, text: str) -> "TokenFlowConfig":
        """From "interval=1.5,mu=2" (the --tokenflow option of the server and the bench)."""
        fields = dict(kv.split("=", 1) for kv in text.split(",") if kv)
        known = list(cls.__dataclass_fields__)
        unknown = fields.keys() - set(known)
        if unknown:
            raise ValueError(f"unknown TokenFlow constant(s) {sorted(unknown)}; known: {known}")
        return cls(**{k: float(v) for k, v in fields.items()})

    @classmethod
    def help(cls) -> str:
        return ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))


# an arrival brings the next rebalance forward, to no sooner than this share of an interval after
# the last: at 20 arrivals/s a rebalance per arrival would cost more than it decides
ARRIVAL_REBALANCE_SHARE = 0.1


class TokenFlow(FCFS):
    """Buffer-aware preemption on top of the baseline: docs/scheduling.md (its steps 1-4)."""

    evicts_to_host = True

    def __init__(self, config: TokenFlowConfig | None = None, fcfs: FCFSConfig | None = None):
        super().__init__(fcfs)
        self.config = config or TokenFlowConfig()
        self.last_rebalance = float("-inf")
        self.keep: set[Request] = set()
        self.joining: list[Request] = []  # the keep-set's waiting members, most urgent first
        self.overloaded = False  # the started readers alone ask for more than the engine makes

    def preemptions(self, s: Scheduler, now: float) -> list[Request]:
        """The running requests that leave the device now to make room for more urgent ones."""
        since = now - self.last_rebalance
        soon = since >= self.config.interval * ARRIVAL_REBALANCE_SHARE
        arrived = s.last_arrival > self.last_rebalance and soon
        if not s.waiting or not (since >= self.config.interval or arrived):
            return []
        self.last_rebalance = now
        step = s.step_time()  # once: a rebalance asks for it per request
        urgency = {r: self.urgency(s, r, now, step) for r in itertools.chain(s.running, s.waiting)}
        started = [r for r in urgency if r.started]
        size = self.lifetime_size(started)  # once: the capacity and the working set use it
        capacity = self.capacity(s, len(started), size, self.config.capacity_share)
        self.overloaded = sum(r.read_rate for r in started) > capacity
        members = self.working_set(s, started, size, capacity, urgency)
        self.keep = self.greedy_fill(s, sorted(members, key=urgency.get))
        self.joining = sorted((r for r in s.waiting if r in self.keep), key=urgency.get)
        return self.victims(s, now, urgency)

    def victims(
        self, s: Scheduler, now: float, urgency: dict[Request, tuple[int, float]]
    ) -> list[Request]:
        """Step 4: running requests outside the keep-set, least urgent first, while needed."""
        joining = [r for r in self.joining if urgency[r][0] < 2]
        blocks = sum(s.blocks_to_decode(r) for r in joining) - s.kv.num_free
        blocks += self.growth_blocks(s, itertools.chain(s.running, joining))
        seats = len(joining) - (s.max_num_seqs - len(s.running))
        link = self.config.interval - (s.swapper.backlog() if s.swapper else 0.0)
        out = []
        others = (r for r in s.running if r not in self.keep)
        for r in sorted(others, key=urgency.get, reverse=True):
            if (blocks <= 0 and seats <= 0) or link <= 0:
                break
            if self.preemptable(s, r, now):
                out.append(r)
                blocks -= s.kv.num_own(r.block_table)
                seats -= 1
                link -= s.swapper.transfer_time(2 * len(r.block_table)) if s.swapper else 0.0
        return out

    def working_set(
        self,
        s: Scheduler,
        started: list[Request],
        size: float,
        capacity: float,
        urgency: dict[Request, tuple[int, float]],
    ) -> list[Request]:
        """The started requests, and newcomers while capacity and an interval's prefill last."""
        demand = sum(r.read_rate for r in started)
        prefill = s.rates.prefill_rate * self.config.interval
        members = list(started)
        newcomers = [r for r in s.waiting if not r.started]
        if self.overloaded and any(urgency[r][0] == 0 for r in s.waiting if r.started):
            # past capacity a paused reader runs dry: the estimates were kind; only the oldest
            # newcomer joins, once it waited an interval (more push readers out, swaps feed swaps)
            due = s.clock() - self.config.interval
            newcomers = [r for r in newcomers[:1] if r.arrival_time <= due]
        # the share kept for switches: none if all fit at once, else one request's share of a batch
        n = len(members) + len(newcomers)
        fits = self.batch_that_fits(s, n, self.lifetime_size(newcomers, size))
        if fits < n:  # readers take turns on the device: its capacity is that of the batch it holds
            capacity = min(capacity, self.config.capacity_share * fits / s.rates.decode_time(fits))
        whole = capacity / self.config.capacity_share
        whole *= 1 - 1 / fits if fits < n else 1.0
        if demand + sum(r.read_rate for r in newcomers) <= whole:
            capacity = max(capacity, whole)  # the last few of a burst need not wait for the share
        for r in newcomers:
            demand += r.read_rate
            prefill -= r.num_new_tokens
            if demand > capacity or prefill < 0:
                break
            members.append(r)
        return members

    def urgency(
        self, s: Scheduler, req: Request, now: float, step: float | None = None
    ) -> tuple[int, float]:
        """Sort key, most urgent first (step 1): run dry before back, newcomers, the rest."""
        if not req.started:
            return 1, req.arrival_time
        slack = req.dry_at - now
        if req.status == RequestStatus.RUNNING and slack > 0:
            slack *= 1 - self.config.hysteresis
        # a switch takes at least an interval and a step, at most a recompute more: outside these
        # bounds (most requests) the estimate of a copy's time is not needed
        step = s.step_time() if step is None else step
        if slack < self.lead(self.config.interval + step):
            return 0, now + slack
        if slack >= self.lead(req.num_tokens / s.rates.prefill_rate + self.config.interval + step):
            return 2, now + slack
        return (0 if slack < self.lead(self.switch_time(s, req, step)) else 2), now + slack

    def lead(self, switch: float) -> float:
        """How long before running dry a request must be back: a switch and an interval."""
        return switch + self.config.interval

    def greedy_fill(self, s: Scheduler, by_urgency: list[Request]) -> set[Request]:
        """The most urgent requests whose KV, grown until the next rebalance, fits on the device."""
        growth = self.growth(s)
        room = s.kv.num_blocks
        keep = set()
        for r in by_urgency[: s.max_num_seqs]:
            need = cdiv(r.num_tokens + min(r.num_tokens_left, growth), s.kv.block_size)
            if need > room:
                break
            keep.add(r)
            room -= need
        return keep

    def growth(self, s: Scheduler) -> float:
        """Tokens a running request adds before the next rebalance."""
        return self.config.interval / s.step_time()

    def preemptable(self, s: Scheduler, req: Request, now: float) -> bool:
        """May req leave the device now (step 4)? Its reader must read through mu switches."""
        settled = req.started and now - req.last_moved >= self.config.interval
        if not settled or req.num_tokens_left * s.step_time() <= self.config.interval:
            return False
        switch = self.switch_time(s, req)
        return req.dry_at - now >= self.lead(switch) + (self.config.mu - 1) * switch

    def switch_time(self, s: Scheduler, req: Request, step: float | None = None) -> float:
        """Seconds to take req off the device (if on it) and back, plus an interval and a step."""
        bs = s.kv.block_size
        on_device = cdiv(req.num_computed_tokens, bs)
        unsynced = max(0, on_device - req.num_host_tokens // bs)
        blocks = max(on_device, cdiv(req.num_host_tokens, bs))
        switch = req.num_tokens / s.rates.prefill_rate  # by recompute
        if s.swapper and blocks and unsynced <= s.swapper.host.num_free:
            switch = min(s.swapper.copy_done_in(unsynced + blocks), switch)
        return switch + self.config.interval + (s.step_time() if step is None else step)

    def victim(self, s: Scheduler, now: float) -> Request:
        """A reader that can wait a switch, else the newest newcomer, else the most buffered."""
        can_wait = [r for r in s.running if self.preemptable(s, r, now)]
        fresh = [r for r in s.running if not r.started]
        if fresh and not can_wait:
            return fresh[-1]
        return max(can_wait or s.running, key=lambda r: r.dry_at)

    def token_budget(self, s: Scheduler, now: float) -> int:
        """A token per running request, and prompt tokens while no reader runs dry meanwhile, or
        when the newcomers' wait they save outweighs the readers' stall they cost."""
        full = s.max_num_batched_tokens
        if self.overloaded or not s.waiting and all(r.num_new_tokens <= 1 for r in s.running):
            return full  # readers stall anyway, or only decodes: nothing to limit
        step = s.step_time()
        # running and resumable paused readers; one faster than a token a step holds no prompt back
        paused = (r for r in self.joining if r.status == RequestStatus.PREEMPTED)
        readers = [
            r for r in itertools.chain(s.running, paused) if r.started and r.read_rate * step < 1
        ]
        slack = min((r.dry_at for r in readers if r.dry_at > now), default=float("inf")) - now
        prompt_tokens = max(0.0, slack - step) * s.rates.prefill_rate
        cut = int(min(full, len(s.running) + prompt_tokens))
        return full if cut < full and self.prompts_outweigh_stalls(s, readers, now, step) else cut

    def prompts_outweigh_stalls(
        self, s: Scheduler, readers: list[Request], now: float, step: float
    ) -> bool:
        """Would a whole budget of prompts now save the newcomers more lateness than it costs the
        readers? A second's wait makes each token a request has still to stream a second late
        (Andes' QoE); a reader's stall counts stall_weight times. Held back, the chunk goes in free
        once every reader it would stall has read ahead by as much: each gains 1/read_rate - step
        seconds a step, or finishes first; none is held for longer than an interval."""
        joining = [r for r in self.joining if r.status in WAITING_STATES]
        newcomers = [r for r in itertools.chain(s.running, joining) if not r.started]
        if not newcomers:
            return False
        room = s.max_num_batched_tokens - len(s.running)
        prompts = list(itertools.accumulate(r.num_new_tokens for r in newcomers))
        served = newcomers[: max(1, sum(n <= room for n in prompts))]
        chunk = min(prompts[-1], room) / s.rates.prefill_rate
        stall = wait = 0.0
        for r in [r for r in readers if r.dry_at < now + chunk + step]:  # those the chunk stalls
            late = chunk + step - max(0.0, r.dry_at - now)
            ahead = min(late / (1 / r.read_rate - step), r.num_tokens_left) * step
            if ahead > self.config.interval:
                return True  # no holding prompts back beyond the next rebalance
            stall += min(chunk, late) * r.num_tokens_left
            wait = max(wait, ahead)
        return wait * sum(r.num_tokens_left for r in served) > self.config.stall_weight * stall

    def admit(self, s: Scheduler, scheduled: dict[Request, int], budget: int, now: float) -> None:
        """The keep-set's waiting members (the rebalance made room for them), then the baseline."""
        members = [r for r in self.joining if r.status in WAITING_STATES]
        listed = set(members)  # and those preempted since, when memory ran short: still members
        members += [r for r in s.waiting if r in self.keep and r not in listed]
        for req in members:
            need = s.blocks_to_start(req) + self.growth_blocks(s, itertools.chain(s.running, [req]))
            if s.full(budget) or need > s.kv.num_free:
                return  # while a member waits for memory, nobody outside the keep-set may take it
            budget = s.start(req, scheduled, budget, now)
        super().admit(s, scheduled, budget, now)

    def growth_blocks(self, s: Scheduler, reqs: Iterable[Request]) -> int:
        """Room for what reqs add until the next rebalance, once host is short (docs/scheduling)."""
        if not s.swapper or s.swapper.host.num_free >= s.kv.num_blocks - s.kv.num_free:
            return 0
        growth = self.growth(s)
        tokens = sum(min(r.num_tokens_left, growth) for r in reqs)
        return cdiv(int(tokens), s.kv.block_size)

    def admission_queue(self, s: Scheduler, now: float) -> Iterable[Request]:
        """The baseline's queue less those preempted within an interval (until a rebalance)."""
        return (
            r
            for r in s.waiting
            if r.status == RequestStatus.WAITING or now - r.last_moved >= self.config.interval
        )

    def resume_by_load(self, s: Scheduler, req: Request) -> bool:
        return s.load_beats_recompute(req.num_host_tokens)

    def after_step(self, s: Scheduler) -> None:
        """Write filled blocks to host, largest buffers first, while a preemption may come."""
        super().after_step(s)
        if s.swapper and self.under_pressure(s):
            # only those that filled a block since their last copy have something to write
            bs = s.kv.block_size
            filled = [r for r in s.running if r.num_computed_tokens // bs > r.num_host_tokens // bs]
            by_buffer = sorted(filled, key=lambda r: -r.dry_at)
            s.swapper.write_through(by_buffer, s.swapper.blocks_in(s.step_time()))

    def under_pressure(self, s: Scheduler) -> bool:
        """May a preemption come? Someone waits, or the pool is nearly full and copies are async."""
        nearly_full = s.kv.num_free < self.config.write_through_below * s.kv.num_blocks
        return bool(s.waiting) or (s.swapper.async_copies and nearly_full)


POLICIES = {"tokenflow": TokenFlow, "fcfs": FCFS}
Policy = FCFS  # the interface every policy implements


def make_policy(name: str, config: TokenFlowConfig | None = None) -> FCFS:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICIES)}")
    return TokenFlow(config) if name == "tokenflow" else FCFS()
