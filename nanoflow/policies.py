"""The two policies: who runs, who waits, who leaves the device (docs/scheduling.md).

`FCFS` is the baseline (SGLang's default): first come, first served, with an estimate of the memory
the running requests will still take. `TokenFlow` (arXiv 2510.02758) builds on it: it ranks
requests by how long their readers' buffers last, preempts those with the largest buffers for
newcomers and for readers about to run dry, resumes each before its reader runs dry, and writes KV
through to host so that a preemption copies little. Its rules beyond the paper are marked
"Extension". Both implement sched.py's `Policy`; this file imports sched.py and request.py.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from .kv import cdiv
from .request import WAITING_STATES, Request, RequestStatus
from .sched import DRY_SOON_HORIZON_S, ESTIMATE_CLIP_TOKENS, Policy, Scheduler


@dataclass
class FCFSConfig:
    """SGLang's admission estimate: `new_token_ratio` of each max_tokens is kept free."""

    init_new_token_ratio: float = 0.7  # SGLang's default start
    min_new_token_ratio: float = 0.1  # ...and its floor (SGLang: 0.14 of the start)
    decay_steps: int = 600  # steps to decay from start to floor (SGLang's default)
    retract_decode_steps: int = 20  # a retraction keeps room for this many more tokens of each


class FCFS:
    """The baseline (SGLang's default, docs/scheduling.md)."""

    evicts_to_host = False
    horizon = DRY_SOON_HORIZON_S

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
            if need > free - reserved or not self.may_start(s, req, now):
                return
            budget = s.start(req, scheduled, budget, now)
            reserved += self.future_tokens(s, req)  # less what it holds now

    def admission_queue(self, s: Scheduler, now: float) -> Iterable[Request]:
        return iter(s.waiting)

    def may_start(self, s: Scheduler, req: Request, now: float) -> bool:
        return True

    def future_tokens(self, s: Scheduler, req: Request) -> int:
        """KV tokens kept free for req: its known tokens, a share of the output it may add."""
        left = min(req.num_tokens_left, ESTIMATE_CLIP_TOKENS)
        return s.blocks_to_decode(req) * s.kv.block_size + int(left * self.new_token_ratio)

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
        start = self.fcfs.init_new_token_ratio
        floor = self.fcfs.min_new_token_ratio
        step = (start - floor) / self.fcfs.decay_steps
        self.new_token_ratio = max(self.new_token_ratio - step, floor)


@dataclass
class TokenFlowConfig:
    """TokenFlow's constants (docs/scheduling.md), in --help of the server and the bench."""

    interval: float = 1.5  # s between reschedules (Δt; the paper: 0.5-1.5 s)
    mu: float = 2.0  # a buffer must cover mu switches (and an interval) to be preempted
    capacity_share: float = 0.8  # of the measured tokens/s readers may ask: switches cost the rest
    write_through_below: float = 0.2  # share of free device KV under which to write through
    stall_weight: float = 1.0  # a reader's second of stall against a newcomer's second of wait
    short_hold: float = 0.3  # s: prompts held back this long for readers, whatever they weigh
    hold_share: float = 0.1  # or as long as this share of the newcomers' wait so far

    @classmethod
    def parse(cls, text: str) -> "TokenFlowConfig":
        """From "interval=1.5,mu=2" (the --tokenflow option of the server and the bench)."""
        fields = dict(kv.split("=", 1) for kv in text.split(",") if kv)
        known = list(cls.__dataclass_fields__)
        unknown = fields.keys() - set(known)
        if unknown:
            raise ValueError(f"unknown TokenFlow constant(s) {sorted(unknown)}; known: {known}")
        return cls(**{k: float(v) for k, v in fields.items()})


# an arrival brings the next rebalance forward, to no sooner than this share of an interval after
ARRIVAL_REBALANCE_SHARE = 0.1


class Urgency(enum.IntEnum):
    """A request's tier in TokenFlow's priority (step 1), most urgent first."""

    DRY_SOON = 0  # a started reader that runs dry before it could be brought back
    NEWCOMER = 1  # not started: waits for its first token
    BUFFERED = 2  # a reader whose buffer outlasts a switch


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
        self.horizon = self.config.interval

    def preemptions(self, s: Scheduler, now: float) -> list[Request]:
        """The rebalance: running requests that leave the device now for more urgent ones."""
        if not s.waiting or not self.rebalance_due(s, now):
            return []
        self.last_rebalance = now
        urgency = self.priority_by_buffer(s, now)
        started = [r for r in urgency if r.started]
        size = s.lifetime_size(started)  # once: the capacity and the working set use it
        capacity = s.capacity(len(started), size, self.config.capacity_share)
        self.overloaded = sum(r.read_rate for r in started) > capacity
        members = self.working_set(s, started, size, capacity, urgency)
        self.keep = self.greedy_fill(s, sorted(members, key=urgency.get))
        # its waiting members, most urgent first: admit() starts them first (back before dry)
        self.joining = sorted((r for r in s.waiting if r in self.keep), key=urgency.get)
        return self.preempt_largest_buffers(s, now, urgency)

    def rebalance_due(self, s: Scheduler, now: float) -> bool:
        """An interval passed since the last rebalance, or an arrival since (not too soon)."""
        since = now - self.last_rebalance
        soon = since >= self.config.interval * ARRIVAL_REBALANCE_SHARE
        arrived = s.last_arrival > self.last_rebalance and soon
        return since >= self.config.interval or arrived

    def priority_by_buffer(self, s: Scheduler, now: float) -> dict[Request, tuple[Urgency, float]]:
        """Step 1: every request's sort key (urgency), most urgent first."""
        step = s.step_time()  # once: urgency asks for it per request
        return {r: self.urgency(s, r, now, step) for r in itertools.chain(s.running, s.waiting)}

    def preempt_largest_buffers(
        self, s: Scheduler, now: float, urgency: dict[Request, tuple[Urgency, float]]
    ) -> list[Request]:
        """Step 4: running requests outside the keep-set, least urgent (the largest buffers)
        first, while the members that cannot wait need blocks or seats."""
        joining = [r for r in self.joining if urgency[r][0] != Urgency.BUFFERED]
        blocks = sum(s.blocks_to_decode(r) for r in joining) - s.kv.num_free
        blocks += self.growth_blocks(s, itertools.chain(s.running, joining))
        rescue = sum(s.blocks_to_decode(r) for r in joining if r.started) - s.kv.num_free
        seats = len(joining) - (s.max_num_seqs - len(s.running))
        link = self.config.interval - (s.swapper.backlog() if s.swapper else 0.0)
        out = []
        others = (r for r in s.running if r not in self.keep)
        for r in sorted(others, key=urgency.get, reverse=True):
            if (blocks <= 0 and seats <= 0) or link <= 0:
                break
            if self.preemptable(s, r, now, rescue=rescue > 0):
                out.append(r)
                blocks -= s.kv.num_own(r.block_table)
                rescue -= s.kv.num_own(r.block_table)
                seats -= 1
                link -= s.swapper.transfer_time(2 * len(r.block_table)) if s.swapper else 0.0
        return out

    def working_set(
        self,
        s: Scheduler,
        started: list[Request],
        size: float,
        capacity: float,
        urgency: dict[Request, tuple[Urgency, float]],
    ) -> list[Request]:
        """Step 2: the started requests, and newcomers while capacity and an interval's
        prefill last."""
        demand = sum(r.read_rate for r in started)
        prefill = s.rates.prefill_rate * self.config.interval
        members = list(started)
        newcomers = [r for r in s.waiting if not r.started]
        # the share kept for switches: none if all fit at once, else one request's share of a batch
        n = len(members) + len(newcomers)
        fits = s.batch_that_fits(n, s.lifetime_size(newcomers, size))
        if fits < n:  # readers take turns on the device: its capacity is that of the batch it holds
            capacity = min(capacity, self.config.capacity_share * fits / s.rates.decode_time(fits))
        # Extension (the burst-tail reserve): the last few of a burst need not wait for the share
        whole = capacity / self.config.capacity_share
        if fits < n:
            whole *= 1 - 1 / fits
        if demand + sum(r.read_rate for r in newcomers) <= whole:
            capacity = max(capacity, whole)
        for r in newcomers:
            demand += r.read_rate
            prefill -= r.num_new_tokens
            if demand > capacity or prefill < 0:
                break
            members.append(r)
        return members

    def urgency(
        self, s: Scheduler, req: Request, now: float, step: float | None = None
    ) -> tuple[Urgency, float]:
        """Sort key, most urgent first (step 1): run dry before back, newcomers, the rest."""
        if not req.started:
            return Urgency.NEWCOMER, req.arrival_time
        slack = req.dry_at - now
        if slack < self.lead(self.switch_time(s, req, step)):
            return Urgency.DRY_SOON, now + slack
        return Urgency.BUFFERED, now + slack

    def lead(self, switch: float) -> float:
        """How long before running dry a request must be back: a switch and an interval."""
        return switch + self.config.interval

    def greedy_fill(self, s: Scheduler, by_urgency: list[Request]) -> set[Request]:
        """Step 3: the most urgent requests whose KV, grown until the next rebalance, fits on
        the device."""
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

    def preemptable(self, s: Scheduler, req: Request, now: float, rescue: bool = False) -> bool:
        """May req leave now (step 4)? Its reader must read through mu switches and it must not end
        within an interval (Extension, the rescue: a comeback will do for a paused reader)."""
        settled = req.started and now - req.last_moved >= self.config.interval
        ends_soon = req.num_tokens_left * s.step_time() <= self.config.interval
        if not settled or (ends_soon and not rescue):
            return False
        switch = self.switch_time(s, req)
        spare = 0.0 if rescue else (self.config.mu - 1) * switch
        return req.dry_at - now >= self.lead(switch) + spare

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
        """A reader that can wait mu switches, else one that can wait a comeback (the rescue), else
        the newest newcomer, else the most buffered of those that outlast an interval."""
        can_wait = [r for r in s.running if self.preemptable(s, r, now)]
        can_wait = can_wait or [r for r in s.running if self.preemptable(s, r, now, rescue=True)]
        fresh = [r for r in s.running if not r.started]
        if fresh and not can_wait:
            return fresh[-1]
        lasting = [r for r in s.running if r.num_tokens_left * s.step_time() > self.config.interval]
        return max(can_wait or lasting or s.running, key=lambda r: r.dry_at)

    def token_budget(self, s: Scheduler, now: float) -> int:
        """Extension (prompts against stalls): a token per running request, and prompt tokens
        while no reader runs dry meanwhile, or when the newcomers' wait they save outweighs
        the readers' stall they cost."""
        whole_budget = s.max_num_batched_tokens
        only_decodes = not s.waiting and all(r.num_new_tokens <= 1 for r in s.running)
        if self.overloaded or only_decodes:
            return whole_budget  # readers stall anyway, or nothing to limit
        step = s.step_time()
        # running and resumable paused readers; one faster than a token a step holds no prompt back
        paused = (r for r in self.joining if r.status == RequestStatus.PREEMPTED)
        readers = [r for r in (*s.running, *paused) if r.started and r.read_rate * step < 1]
        slack = min((r.dry_at for r in readers if r.dry_at > now), default=float("inf")) - now
        prompt_tokens = max(0.0, slack - step - s.rates.mixed_overrun) * s.rates.prefill_rate
        cut = int(min(whole_budget, len(s.running) + prompt_tokens))
        if cut < whole_budget and self.prompts_outweigh_stalls(s, readers, now, step):
            return whole_budget
        return cut

    def prompts_outweigh_stalls(
        self, s: Scheduler, readers: list[Request], now: float, step: float
    ) -> bool:
        """Would a whole budget of prompts now save the newcomers more lateness than it
        costs the readers? A second's wait makes each token still to stream a second late
        (Andes' QoE); a stall counts stall_weight times. Held back, the chunk goes in once
        each reader it stalls has read ahead as much (1/read_rate - step s a step) or has
        finished. Holds up to short_hold or hold_share of the wait so far are always taken."""
        joining = [r for r in self.joining if r.status in WAITING_STATES]
        newcomers = [r for r in itertools.chain(s.running, joining) if not r.started]
        if not newcomers:
            return False
        room = s.max_num_batched_tokens - len(s.running)
        prompts = list(itertools.accumulate(r.num_new_tokens for r in newcomers))
        served = newcomers[: max(1, sum(n <= room for n in prompts))]
        chunk = min(prompts[-1], room) / s.rates.prefill_rate
        stall = 0.0
        wait = 0.0
        for r in [r for r in readers if r.dry_at < now + chunk + step]:  # those the chunk stalls
            late = chunk + step - max(0.0, r.dry_at - now)
            ahead = min(late / (1 / r.read_rate - step), r.num_tokens_left) * step
            if ahead > self.config.interval:
                return True  # no holding prompts back beyond the next rebalance
            stall += min(chunk, late) * r.num_tokens_left
            wait = max(wait, ahead)
        waited = min(now - r.arrival_time for r in served)
        if wait <= max(self.config.short_hold, self.config.hold_share * waited):
            return False  # readers first: no stall that fcfs would not cause
        return wait * sum(r.num_tokens_left for r in served) > self.config.stall_weight * stall

    def admit(self, s: Scheduler, scheduled: dict[Request, int], budget: int, now: float) -> None:
        """The keep-set's waiting members (the rebalance made room), then the baseline."""
        members = [r for r in self.joining if r.status in WAITING_STATES]
        listed = set(members)  # and those preempted since, when memory ran short: still members
        members += [r for r in s.waiting if r in self.keep and r not in listed]
        for req in members:
            need = s.blocks_to_start(req) + self.growth_blocks(s, itertools.chain(s.running, [req]))
            if s.full(budget) or need > s.kv.num_free or not self.may_start(s, req, now):
                return  # while a member waits for memory, nobody outside the keep-set may take it
            budget = s.start(req, scheduled, budget, now)
        super().admit(s, scheduled, budget, now)

    def may_start(self, s: Scheduler, req: Request, now: float) -> bool:
        """Extension (the stall-free start): a newcomer starts only while the device holds the
        running requests and it until each has read far enough ahead to wait mu switches, or has
        ended: memory that runs short later finds a reader that can wait (docs/scheduling.md)."""
        if req.started or not s.running:
            return True
        step = s.rates.decode_time(len(s.running) + 1)
        unready = [r for r in s.running if not self.preemptable(s, r, now)]  # the rest can wait
        lives = [self.life(s, r, now, step) for r in [*unready, req]]
        return peak_blocks(lives, s.kv.block_size) <= s.kv.num_blocks

    def life(self, s: Scheduler, req: Request, now: float, step: float) -> tuple[int, float]:
        """req's tokens, and the steps until its reader could wait mu switches or it ends (all
        of its tokens left, if its reader reads a token a step or faster)."""
        steps = req.num_tokens_left
        gain = 1 - req.read_rate * step  # of buffer, in tokens, a step adds
        if gain > 0:
            switch = self.switch_time(s, req, step)
            wait = self.lead(switch) + (self.config.mu - 1) * switch  # as preemptable() asks
            short = max(0.0, wait - max(0.0, req.dry_at - now))
            steps = min(steps, short * req.read_rate / gain)
        return req.num_tokens, steps

    def growth_blocks(self, s: Scheduler, reqs: Iterable[Request]) -> int:
        """Extension (the growth reserve): room for what reqs add until the next rebalance,
        once the host pool is short (docs/scheduling.md)."""
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
        super().after_step(s)
        if s.swapper and self.under_pressure(s):
            self.write_through(s)

    def write_through(self, s: Scheduler) -> None:
        """Copy freshly filled blocks to host, largest buffers first (the first to be preempted),
        as many as the link copies in a step: a preemption then copies only the tail."""
        bs = s.kv.block_size
        filled = [r for r in s.running if r.num_computed_tokens // bs > r.num_host_tokens // bs]
        by_buffer = sorted(filled, key=lambda r: -r.dry_at)
        s.swapper.write_through(by_buffer, s.swapper.blocks_in(s.step_time()))

    def under_pressure(self, s: Scheduler) -> bool:
        """May a preemption come? Someone waits, or the pool is nearly full (async copies)."""
        nearly_full = s.kv.num_free < self.config.write_through_below * s.kv.num_blocks
        return bool(s.waiting) or (s.swapper.async_copies and nearly_full)


def peak_blocks(lives: list[tuple[int, float]], block_size: int) -> float:
    """The most KV blocks held at once by requests that each hold `tokens`, add one a step and
    leave after `steps`: those left just before one leaves, when the most tokens are held."""
    held = sum(tokens for tokens, _ in lives)
    count = len(lives)
    moments = []  # (tokens held just before one leaves, after how many steps)
    for tokens, steps in sorted(lives, key=lambda life: life[1]):
        moments.append((held + count * steps, steps))
        held -= tokens
        count -= 1
    _, moment = max(moments, default=(0, 0))
    return sum(cdiv(tokens + moment, block_size) for tokens, steps in lives if steps >= moment)


POLICIES = {"tokenflow": TokenFlow, "fcfs": FCFS}


def make_policy(name: str | Policy, config: TokenFlowConfig | None = None) -> Policy:
    """The policy a name stands for (a policy object is taken as it is)."""
    if not isinstance(name, str):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(POLICIES)}")
    return TokenFlow(config) if name == "tokenflow" else FCFS()
