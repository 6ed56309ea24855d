"""A request and how it samples: its tokens, its KV blocks, its reader (who reads it, how fast).

`SamplingParams` checks what a client asked for (vLLM's names and defaults); `Request` is one
generation as the scheduler, the engine and the server see it. `dry_at` is the reader model of
docs/scheduling.md: when the reader runs out of tokens to read. Imports only metrics.py (the
reader model), so that every other room may import this one.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

import torch

from .metrics import RequestRecord, read_times


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
        """Checks every field against PARAM_RULES; `stop`, `stop_token_ids` and `logit_bias`
        come back in one shape (a list, a list, a map of ints to floats)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = self.stop or []
        self.stop_token_ids = self.stop_token_ids or []
        self.logit_bias = self.logit_bias or {}
        for name, (valid, rule) in PARAM_RULES.items():
            if not valid(getattr(self, name), self):
                raise ValueError(
                    f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}"
                )
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}  # JSON: str keys


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


def is_bias(token, bias) -> bool:
    return str(token).isdigit() and is_number(bias) and abs(bias) <= 100


# field: (valid(value, params), what it must be)
PARAM_RULES = {
    "max_tokens": (lambda v, p: is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v, p: is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v, p: is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v, p: is_int(v) and v >= -1, "-1 or 0 (off) or an integer >= 1"),
    "min_p": (lambda v, p: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": (lambda v, p: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v, p: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (lambda v, p: is_number(v) and v > 0, "a number > 0"),
    "min_tokens": (
        lambda v, p: is_int(v) and 0 <= v <= p.max_tokens,
        "an integer in [0, max_tokens]",
    ),
    "logprobs": (
        lambda v, p: v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS),
        f"None or an integer in [0, {MAX_LOGPROBS}]",
    ),
    "stop_token_ids": (
        lambda v, p: isinstance(v, list) and all(is_int(t) and t >= 0 for t in v),
        "a list of token ids",
    ),
    "logit_bias": (
        lambda v, p: isinstance(v, dict) and all(is_bias(k, b) for k, b in v.items()),
        "a map from token id to a number in [-100, 100]",
    ),
    "seed": (
        lambda v, p: v is None or (is_int(v) and -(2**63) <= v < 2**64),
        "a 64-bit integer or None",
    ),
    "ignore_eos": (lambda v, p: isinstance(v, bool), "a bool"),
    "json_schema": (
        lambda v, p: v is None or isinstance(v, dict),
        "a JSON schema (a dict) or None",
    ),
    "read_rate": (
        lambda v, p: v is None or (is_number(v) and v > 0),
        "a number > 0 (tokens/s) or None",
    ),
    "stop": (
        lambda v, p: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
        "a non-empty string or a list of them",
    ),
}


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its reader still reading what it has
    FINISHED = "finished"


WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


_request_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """One generation: its tokens, how many have KV computed, the KV blocks that hold them."""

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
    dry_at: float = field(init=False)  # when its reader runs dry; in the past: it stalls now

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        reads = read_times(self.token_times, self.read_rate)
        self.dry_at = reads[-1] + 1.0 / self.read_rate if reads else self.arrival_time

    def append(self, token: int, now: float) -> None:
        """A token generated now: its reader reads it at once, or after the one before."""
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


def loaded(req: Request) -> bool:
    """Is req's KV on the device? A resumed request joins the batch once its own load is done."""
    return req.load_event is None or req.load_event.query()
