"""The bench's workloads: who arrives when, with how long a prompt and answer, reading how fast.

`build_workload` turns the command line into one `Workload` from a seed (a burst, Poisson arrivals,
an Azure or Mooncake trace, or chats that resend the conversation), shared by every policy of a
run. `--read-rate auto` scales the paper's reader mix to the engine that a warm-up probe measured
(`probe_workload`, `decode_rates`, `auto_rates`).
"""

import argparse
import csv
import dataclasses
import functools
import gzip
import itertools
import json
import math
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass

from nanoflow import SamplingParams
from nanoflow.engine import READ_RATE_MAX, clamp_read_rate
from nanoflow.kv import cdiv

TRACE_CREDIT = (
    'Azure LLM inference trace 2023 (CC-BY-4.0), from Patel et al., "Splitwise: '
    'Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024'
)
MOONCAKE_CREDIT = (
    "Mooncake's synthetic trace (Apache-2.0), from Qin et al., \"Mooncake: "
    'Trading More Storage for Less Computation", FAST 2025'
)
TRACE_BLOCK = 512  # tokens behind each of a Mooncake trace's hash ids
PAPER_MIX = "15:0.4,20:0.6"  # TokenFlow's reader mix: 40% read at 15 tok/s, 60% at 20
# auto rates: the readers' peak total demand takes DEMAND_SHARE of the measured capacity, and the
# fastest reader reads at most SPEED_SHARE as fast as a running request decodes
DEMAND_SHARE = 0.7
SPEED_SHARE = 0.5
BLOCK_SIZE = 16  # tokens per KV block in every engine the bench builds
PROBE_TOKENS = 16  # output tokens of each warm-up request that measures decode speed
PROMPT_VOCAB = 256  # prompt ids are drawn below this: valid for every model; content is irrelevant


@dataclass
class Workload:
    """A run's requests, sorted by arrival: built once from the seed, shared by all policies."""

    arrival: list[float]  # s after the start of the run
    prompt_len: list[int]
    output_len: list[int]
    rate: list[float]  # tokens/s of each request's reader
    seed: int
    source: str
    block_ids: list[list[int]] | None = None  # a Mooncake trace's: equal ids, equal blocks
    block_tokens: int = TRACE_BLOCK  # tokens behind each of block_ids
    # a later turn's previous turn (negative: none); its arrival counts from that turn's last token
    follows: list[int] | None = None

    def __len__(self) -> int:
        return len(self.arrival)

    def prompt_ids(self, i: int, history: list[int] = ()) -> list[int]:
        """The trace's blocks, or `history` (a previous turn's prompt and answer) and new tokens."""
        if self.block_ids:
            blocks = (trace_block(b, self.block_tokens) for b in self.block_ids[i])
            return list(b"".join(blocks)[: self.prompt_len[i]])
        rng = random.Random(self.seed * 1_000_003 + i)
        new = [rng.randrange(PROMPT_VOCAB) for _ in range(self.prompt_len[i] - len(history))]
        return [*history, *new][: self.prompt_len[i]]

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.output_len[i], temperature=0, ignore_eos=True, read_rate=self.rate[i]
        )

    def clamped(self, context: int) -> "Workload":
        """Prompts and outputs cut to fit a context (a prompt keeps at least one token of room)."""
        prompts = [min(p, context - 1) for p in self.prompt_len]
        outputs = [max(1, min(o, context - p)) for p, o in zip(prompts, self.output_len)]
        cut = sum(p + o > context for p, o in zip(self.prompt_len, self.output_len))
        source = self.source + (f"; {cut} cut to {context} tokens" if cut else "")
        return dataclasses.replace(self, prompt_len=prompts, output_len=outputs, source=source)


@functools.cache
def trace_block(block_id: int, size: int) -> bytes:
    """The tokens (bytes: below PROMPT_VOCAB) of one of a trace's hash ids."""
    return random.Random(block_id).randbytes(size)


def read_trace(path: str, time_scale: float) -> list[tuple]:
    """(arrival_s, prompt_tokens, output_tokens, hash_ids or None) of a CSV or Mooncake JSONL."""
    if ".jsonl" in path:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            rows = [
                (r["timestamp"] / 1e3, r["input_length"], r["output_length"], r["hash_ids"])
                for r in map(json.loads, f)
            ]
    else:
        with open(path) as f:
            rows = [
                (float(r["arrival_s"]), int(r["prompt_tokens"]), int(r["output_tokens"]), None)
                for r in csv.DictReader(f)
            ]
    return sorted((a * time_scale, *rest) for a, *rest in rows)


def lru_hit_rate(block_ids: list[list[int]], capacity: int) -> float:
    """Share of prompt blocks a plain LRU of `capacity` blocks holds as a leading run (a bound)."""
    cache = OrderedDict()
    hits = 0
    for ids in block_ids:
        hits += next((k for k, h in enumerate(ids) if h not in cache), len(ids))
        for h in ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / max(1, sum(map(len, block_ids)))


def parse_dist(text: str) -> tuple[float, float]:
    """'MEAN' or 'MEAN:SPREAD' (a normal distribution; spread defaults to a quarter of the mean)."""
    mean, _, spread = text.partition(":")
    return float(mean), float(spread) if spread else float(mean) / 4


def parse_mix(text: str) -> list[tuple[float, float]]:
    """'20' or '15:0.4,20:0.6' -> [(rate, share), ...]."""
    pairs = [item.partition(":") for item in text.split(",")]
    return [(float(r), float(s) if s else 1.0) for r, _, s in pairs]


def later_turns(args: argparse.Namespace, rng, length, arrival, prompts, outputs) -> list[int]:
    """Appends turns 2.. of the conversations: turn k of conversation c is request k * N + c, the
    previous prompt and answer plus a new message, sent a think time after that answer ends."""
    n = args.multi_turn
    for i in range(n, n * args.turns):
        arrival.append(args.think_time * rng.expovariate(1.0))
        prompts.append(prompts[i - n] + outputs[i - n] + length(args.prompt_len))
        outputs.append(length(args.output_len))
    return [i - n for i in range(n * args.turns)]


def build_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)

    def length(dist: str) -> int:
        return max(1, round(rng.gauss(*parse_dist(dist))))

    block_ids = follows = None
    if args.trace:
        rows = read_trace(args.trace, args.time_scale)
        if args.conversations:  # a conversation's turns share their first hash id
            firsts = set(list(dict.fromkeys(r[3][0] for r in rows))[: args.conversations])
            rows = [r for r in rows if r[3][0] in firsts]
        arrival, prompts, outputs, block_ids = map(list, zip(*rows))
        block_ids = block_ids if block_ids[0] is not None else None
        # smaller blocks, shorter prompts: the same prefix structure at a smaller scale
        prompts = [math.ceil(n * args.trace_block / TRACE_BLOCK) for n in prompts]
        source = f"trace {args.trace} ({len(rows)} requests, time x{args.time_scale})"
    else:
        if args.burst:
            arrival = [0.0] * args.burst
            source = f"burst of {args.burst} at t=0"
        elif args.multi_turn:  # the first turns spread over one think time
            arrival = sorted(rng.uniform(0, args.think_time) for _ in range(args.multi_turn))
            source = (
                f"{args.multi_turn} conversations of {args.turns} turns, think time "
                f"{args.think_time} s, the prompt of each turn a new message"
            )
        else:
            arrival = []
            t = rng.expovariate(args.poisson)
            while t < args.duration:
                arrival.append(t)
                t += rng.expovariate(args.poisson)
            source = f"poisson {args.poisson}/s for {args.duration} s ({len(arrival)} requests)"
        prompts = [length(args.prompt_len) for _ in arrival]
        outputs = [length(args.output_len) for _ in arrival]
        if args.multi_turn:
            follows = later_turns(args, rng, length, arrival, prompts, outputs)
        source += f"; prompt {args.prompt_len}, output {args.output_len} tokens"
    mix = parse_mix(PAPER_MIX if args.read_rate == "auto" else args.read_rate)
    rates = rng.choices([r for r, _ in mix], [s for _, s in mix], k=len(arrival))
    rates = [clamp_read_rate(r) for r in rates]
    return Workload(
        arrival, prompts, outputs, rates, args.seed, source, block_ids, args.trace_block, follows
    )


# ---------------------------------------------------------------- readers: `--read-rate auto`


def levels(ups: list[float], downs: list[float]) -> list[tuple[float, int]]:
    """(time, how many of `ups` minus how many of `downs` have passed) at each of their times."""
    events = sorted([(t, 1) for t in ups] + [(t, -1) for t in downs])
    return list(zip([t for t, _ in events], itertools.accumulate(d for _, d in events)))


def auto_rates(w: Workload, speed: float, capacity: float) -> tuple[Workload, str]:
    """Scale the paper's mix: readers slower than decoding, their demand within capacity."""
    mean = sum(w.rate) / len(w)
    by_speed = SPEED_SHARE * speed * mean / max(w.rate)
    target = by_speed
    for _ in range(5):  # the peak number of readers depends on how long each takes to read
        # the most requests reading at once, if each is read from its arrival at `target`
        ends = [a + n / target for a, n in zip(w.arrival, w.output_len)]
        peak = max((n for _, n in levels(w.arrival, ends)), default=0)
        target = min(by_speed, DEMAND_SHARE * capacity / peak)
    scaled = dataclasses.replace(w, rate=[clamp_read_rate(r * (target / mean)) for r in w.rate])
    why = (
        f"a running request decodes at {speed:.1f} tok/s and the engine at {capacity:.0f} "
        f"tok/s; up to {peak} read at once; so the paper's mix {PAPER_MIX} is scaled by "
        f"{target / mean:.3g} to a mean of {sum(scaled.rate) / len(w):.2f} tok/s: the fastest "
        f"reader reads {max(scaled.rate) / speed:.0%} of decode speed, peak demand is "
        f"{peak * target / capacity:.0%} of capacity"
    )
    return scaled, why


def probe_workload(w: Workload, num_blocks: int, step_tokens: int) -> Workload:
    """As many requests as KV holds, prompts of the mean decoding context, to decode together."""
    prompt, output = statistics.mean(w.prompt_len), statistics.mean(w.output_len)
    n = max(1, min(len(w), num_blocks // cdiv(round(prompt + output), BLOCK_SIZE)))
    prompt = round(prompt + output / 2)
    tokens = PROBE_TOKENS + cdiv(n * prompt, step_tokens)
    prompt = max(1, min(prompt, num_blocks // n * BLOCK_SIZE - tokens))
    return Workload([0.0] * n, [prompt] * n, [tokens] * n, [READ_RATE_MAX] * n, w.seed + 1, "probe")


def decode_rates(records: list) -> tuple[float, float]:
    """(tokens/s of one request, of the engine) while every request of the probe decodes."""
    lo, hi = max(r.token_times[0] for r in records), min(r.token_times[-1] for r in records)
    tokens = sum(lo < t <= hi for r in records for t in r.token_times)
    return tokens / len(records) / (hi - lo), tokens / (hi - lo)
