"""nanoflow's benchmark: the same workload under each scheduling policy, side by side.

`python bench.py --burst 64` builds one workload from a seed (arrivals, prompt and output lengths,
each request's reading rate), runs it on the engine once per policy and prints TTFT, stalls, QoE
and throughput of each (docs/scheduling.md). `--simulate` drives a simulated engine on a virtual
clock, `--http URL` a running server (timed at the client); `--multi-turn N` runs chats that resend
the conversation. `--gpu-check` times the GPU parts.
"""

import argparse
import copy
import csv
import dataclasses
import functools
import gc
import gzip
import heapq
import http.client
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import torch

from nanoflow import LLM, SamplingParams
from nanoflow.attention import decode_attention_triton
from nanoflow.engine import (
    READ_RATE_MAX,
    DecodeGraphs,
    EngineConfig,
    busy_cpu_seconds,
    clamp_read_rate,
)
from benchmarks.fleet import ROUTERS, make_router, simulate
from nanoflow.kv import KVPool, build_metadata, cdiv
from nanoflow.metrics import TTFT_SLO, TTFT_TARGET, RequestRecord, read_times, summarize
from nanoflow.model import Transformer, rope_inv_freq
from nanoflow.sched import POLICIES, TokenFlow, TokenFlowConfig, make_policy
from benchmarks.sim import LLAMA3_8B, PRESETS, CostModel, build_engine, calibrate, kv_bytes_per_token
from nanoflow.swap import Swapper

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
CPU_SLO_SCALE = 2.5  # the TTFT SLO on a CPU: its prompts take ~10x a GPU's, its outputs are short
SPEED_SHARE = 0.5
GOOD_SHARE = 0.97  # --find-replicas: the share of requests that must reach QoE >= 0.95
DEFAULT_KV_FRAC = 0.3  # device KV pool: this share of what the whole burst needs at full length
BLOCK_SIZE = 16
PROBE_TOKENS = 16  # output tokens of each warm-up request that measures decode speed
PROMPT_VOCAB = 256  # prompt ids are drawn below this: valid for every model; content is irrelevant
HTTP_TIMEOUT_S = 600.0
# the engine's flags that bench takes (the others are bench's own or set per policy)
ENGINE_FLAGS = [
    "device",
    "dtype",
    "enforce_eager",
    "tensor_parallel_size",
    "num_kv_blocks",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "tokenflow",
    "cpu_threads",
]
NOT_QUIET_SHARE = 0.05  # other processes' share of the CPUs during a run that makes it suspect
COUNTERS = (
    "preemptions",
    "resumes_load",
    "resumes_recompute",
    "bytes_to_host",
    "bytes_to_device",
    "prefix_queried_tokens",
    "prefix_hit_tokens",
    "prefix_host_hit_tokens",
)


# ---------------------------------------------------------------- the workload


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
    cache, hits = OrderedDict(), 0
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
    length = lambda dist: max(1, round(rng.gauss(*parse_dist(dist))))  # noqa: E731
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
            arrival, source = [0.0] * args.burst, f"burst of {args.burst} at t=0"
        elif args.multi_turn:  # the first turns spread over one think time
            arrival = sorted(rng.uniform(0, args.think_time) for _ in range(args.multi_turn))
            source = (
                f"{args.multi_turn} conversations of {args.turns} turns, think time "
                f"{args.think_time} s, the prompt of each turn a new message"
            )
        else:
            arrival, t = [], rng.expovariate(args.poisson)
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


# ---------------------------------------------------------------- drivers


@dataclass
class MachineWatch:
    """What the rest of the machine did during a real-engine run: the load average before and
    after, and the share of the CPUs that other processes used. A CPU engine's step slows down
    several times when another process computes beside it, so such a run is not evidence."""

    load_before: float = field(default_factory=lambda: os.getloadavg()[0])
    busy: float = field(default_factory=busy_cpu_seconds)
    own: float = field(default_factory=time.process_time)
    wall: float = field(default_factory=time.monotonic)

    def report(self) -> dict:
        wall = time.monotonic() - self.wall
        share = float("nan")  # not on Linux: unknown
        if self.busy is not None:
            others = busy_cpu_seconds() - self.busy - (time.process_time() - self.own)
            share = max(0.0, others) / max(wall * os.cpu_count(), 1e-9)
        return {
            "load_before": self.load_before,
            "load_after": os.getloadavg()[0],
            "others_cpu_share": share,
        }


def describe_machine(name: str, m: dict) -> str:
    line = (
        f"{name}: load average {m['load_before']:.2f} before, {m['load_after']:.2f} after; "
        f"other processes used {m['others_cpu_share']:.0%} of the CPUs"
    )
    if m["others_cpu_share"] > NOT_QUIET_SHARE:
        line += " -- WARNING: the machine was not quiet; these numbers are not evidence"
    return line


@dataclass
class Run:
    """One policy's pass over the workload."""

    name: str
    records: list
    start: float  # when the first request arrived, on the run's clock
    counters: dict = field(default_factory=dict)
    wall: float = 0.0
    requests: list = field(default_factory=list)  # the engine's, in the workload's order
    ttft_slo: float = TTFT_SLO
    machine: dict = field(default_factory=dict)  # MachineWatch.report() of a real-engine run
    decisions: list = field(default_factory=list)  # --fidelity: every Decision of the run

    @functools.cached_property
    def summary(self) -> dict:
        end = max((r.token_times[-1] for r in self.records if r.token_times), default=self.start)
        makespan = max(end - self.start, 1e-9)  # no token at all: every request failed
        return {
            **summarize(self.records, makespan, self.ttft_slo),
            **self.counters,
            "wall_s": self.wall,
        }


class Progress:
    """One line on stderr, rewritten at most a few times a second."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.last, self.begin = label, total, 0.0, time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= 0.25

    def show(self, done: int, tokens: int, final: bool = False) -> None:
        self.last = time.monotonic()
        bar = "#" * (20 * done // max(1, self.total))
        print(
            f"\r{self.label:>10} [{bar:<20}] {done}/{self.total} done, {tokens} tokens, "
            f"{self.last - self.begin:.0f} s",
            end="\n" * final,
            file=sys.stderr,
            flush=True,
        )


def drive(engine, w: Workload, label: str) -> Run:
    """Add due requests and step, idle till the next; a turn is due a think time after the last."""
    wall, before = time.monotonic(), engine.stats()
    start, reqs, bar = engine.clock(), {}, Progress(label, len(w))
    virtual_clock = hasattr(engine.clock, "advance_to")
    follows = w.follows or [-1] * len(w)
    due = [(start + a, i) for i, (a, f) in enumerate(zip(w.arrival, follows)) if f < 0]
    turns = {f: i for i, f in enumerate(follows) if f >= 0}  # previous turn -> next turn
    while due or engine.has_unfinished():
        while due and due[0][0] <= engine.clock():
            t, i = heapq.heappop(due)
            history = reqs[follows[i]].token_ids if follows[i] >= 0 else ()
            reqs[i] = engine.add_request(w.prompt_ids(i, history), w.params(i), arrival_time=t)
        if engine.has_unfinished():
            engine.step()
        elif due and virtual_clock:  # idle until the next arrival: jump a virtual clock
            engine.clock.advance_to(due[0][0])
        elif due:  # or sleep on a real one
            time.sleep(max(0.0, due[0][0] - engine.clock()))
        for prev in [p for p in turns if p in reqs and reqs[p].is_finished]:
            i = turns.pop(prev)
            heapq.heappush(due, (reqs[prev].token_times[-1] + w.arrival[i], i))
        if bar.due():
            bar.show(
                sum(r.is_finished for r in reqs.values()),
                sum(r.num_output_tokens for r in reqs.values()),
            )
    reqs = [reqs[i] for i in range(len(w))]
    bar.show(len(reqs), sum(r.num_output_tokens for r in reqs), final=True)
    counters = {k: engine.stats()[k] - before[k] for k in COUNTERS}
    return Run(
        label,
        [r.record() for r in reqs],
        start + w.arrival[0],
        counters,
        time.monotonic() - wall,
        reqs,
    )


def drive_fleet(engine, w: Workload, label: str, router: str, args: argparse.Namespace) -> Run:
    """w on --replicas copies of the warmed-up engine behind the router (benchmarks/fleet.py)."""
    engines = [copy.deepcopy(engine) for _ in range(args.replicas)]
    before, wall = engine.stats(), time.monotonic()
    reqs, _, start = simulate(engines, w, make_router(router, args.seed), args.scrape_interval)
    counters = {k: sum(e.stats()[k] - before[k] for e in engines) for k in COUNTERS}
    return Run(
        f"{router}/{label}",
        [r.record() for r in reqs],
        start + w.arrival[0],
        counters,
        time.monotonic() - wall,
        reqs,
    )


def find_replicas(engine, w: Workload, label: str, router: str, args: argparse.Namespace) -> Run:
    """The fleet with the fewest replicas where >= GOOD_SHARE of requests reach QoE >= 0.95: from
    --replicas, doubling until one does, then bisecting. Prints every size tried (the curve)."""
    runs = {}

    def good(n: int) -> bool:
        runs[n] = drive_fleet(
            engine, w, label, router, argparse.Namespace(**{**vars(args), "replicas": n})
        )
        return runs[n].summary["qoe_good_share"] >= GOOD_SHARE

    low, high = 0, args.replicas
    while not good(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if good(middle) else (middle, high)
    curve = ", ".join(f"{n}: {r.summary['qoe_good_share']:.0%}" for n, r in sorted(runs.items()))
    print(f"{router}/{label}: {high} replicas (QoE >= 0.95 share by replicas: {curve})")
    runs[high].name += f" x{high}"
    return runs[high]


def http_call(url: str, method: str, path: str, body: dict | None = None):
    """A request to the server at url (with or without /v1); the response, headers read."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=HTTP_TIMEOUT_S)
    path = parts.path.rstrip("/").removesuffix("/v1") + path
    conn.request(method, path, body and json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def http_stream(url: str, w: Workload, i: int, start: float, out: list) -> None:
    """One request as an OpenAI streaming completion; out[i] gets the client-side token times."""
    time.sleep(max(0.0, start + w.arrival[i] - time.monotonic()))
    times, tokens = [], 0
    body = {
        "prompt": w.prompt_ids(i),
        "max_tokens": w.output_len[i],
        "temperature": 0,
        "ignore_eos": True,
        "read_rate": w.rate[i],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        resp = http_call(url, "POST", "/v1/completions", body)
        if resp.status != 200:
            error = resp.read().decode(errors="replace")
            print(f"request {i}: HTTP {resp.status}: {error}", file=sys.stderr)
        for line in resp if resp.status == 200 else []:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                if any(c.get("text") for c in chunk["choices"]):
                    times.append(time.monotonic())
    except OSError as e:
        print(f"request {i}: {e}", file=sys.stderr)
    # a chunk that carries several tokens (a character split across tokens) counts them at the end
    out[i] = times + times[-1:] * (tokens - len(times))


def scrape_counters(url: str) -> dict[str, float]:
    text = http_call(url, "GET", "/metrics").read().decode()
    values = dict(x.rsplit(" ", 1) for x in text.splitlines() if x and not x.startswith("#"))
    return {k: float(values.get(f"nanoflow_{k}_total", 0)) for k in COUNTERS}


def drive_http(url: str, w: Workload) -> Run:
    """The workload through a running server: one thread per request, timed at the client."""
    try:
        while b'"loading"' in http_call(url, "GET", "/health").read():  # its checkpoint
            time.sleep(1)
        wall, before = time.monotonic(), scrape_counters(url)
    except OSError as e:
        raise SystemExit(f"no server at {url} ({e}); start one: python -m nanoflow.serve") from None
    start, times = time.monotonic() + 0.1, [None] * len(w)
    threads = [
        threading.Thread(target=http_stream, args=(url, w, i, start, times), daemon=True)
        for i in range(len(w))
    ]
    for t in threads:
        t.start()
    bar = Progress("http", len(w))
    while any(t.is_alive() for t in threads):
        bar.show(sum(x is not None for x in times), sum(len(x) for x in times if x))
        time.sleep(0.1)
    bar.show(len(w), sum(len(x) for x in times), final=True)
    records = [RequestRecord(start + a, x or [], r) for a, x, r in zip(w.arrival, times, w.rate)]
    counters = {k: int(v - before[k]) for k, v in scrape_counters(url).items()}
    return Run("http", records, start + w.arrival[0], counters, time.monotonic() - wall)


def engine_factory(args: argparse.Namespace, w: Workload):
    """policy -> a fresh engine (real or simulated), and a description of it."""
    all_memory = args.simulate or args.trace or args.multi_turn
    frac = args.kv_frac or (None if all_memory else DEFAULT_KV_FRAC)
    need = [cdiv(p + o, BLOCK_SIZE) for p, o in zip(w.prompt_len, w.output_len)]
    # a device pool that holds `frac` of the workload at full length, and the largest request
    blocks = args.num_kv_blocks or (max(max(need), math.ceil(frac * sum(need))) if frac else None)
    if args.simulate:
        make = functools.partial(
            build_engine,
            args.preset,
            num_kv_blocks=blocks,
            tokenflow=args.tokenflow,
            charge_scheduler=not args.uncharged,
            host_kv_gb=args.host_kv_gb,
            jitter=args.jitter,
            seed=args.jitter_seed,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        return make, f"simulated: {cost_model(args.preset).describe()}"
    host_kv_gb = EngineConfig.host_kv_gb if args.host_kv_gb is None else args.host_kv_gb
    options = {
        **EngineConfig.flag_values(args, ENGINE_FLAGS),
        "num_kv_blocks": blocks,
        "block_size": BLOCK_SIZE,
        "host_kv_gb": host_kv_gb,
    }
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"{os.cpu_count()} CPUs"
    where = f"{args.ckpt or 'demo model'} on {device} ({name}, torch {torch.__version__})"
    return (lambda policy: LLM(args.ckpt, policy=policy, **options).engine), f"real engine: {where}"


def cost_model(preset: str | CostModel) -> CostModel:
    """--preset's cost model, or the one --fidelity fitted to this engine."""
    return preset if isinstance(preset, CostModel) else PRESETS[preset]()


def run_policies(args: argparse.Namespace, w: Workload) -> tuple[list[Run], Workload, dict]:
    """Each policy on a fresh engine: the same warm-up probe, then the identical workload."""
    make, where = engine_factory(args, w)
    runs, info = [], {"engine": where}
    for policy in args.policies.split(","):
        engine = make(policy=policy)
        blocks = engine.stats()["device_blocks_total"]
        if not args.simulate:
            info["threads"] = engine.threads.describe() if engine.threads else "a GPU"
        context = min(engine.max_model_len, blocks * BLOCK_SIZE)  # the pool must hold a request
        w = w.clamped(context)
        probe = probe_workload(w, blocks, engine.scheduler.max_num_batched_tokens)
        probe = drive(engine, probe.clamped(context), "warm-up")
        if not runs:
            speed, capacity = decode_rates(probe.records)
            info.update(
                host_blocks=engine.stats()["host_blocks_total"],
                kv_blocks=blocks,
                probe_batch=len(probe.records),
                decode_speed=speed,
                capacity=capacity,
                rates=f"{args.read_rate} (as given)",
                prefill_rate=engine.scheduler.rates.prefill_rate,
            )
            if args.read_rate == "auto":
                w, info["rates"] = auto_rates(w, speed, capacity * (args.replicas or 1))
        if args.replicas:
            run_fleet = find_replicas if args.find_replicas else drive_fleet
            runs += [run_fleet(engine, w, policy, r, args) for r in args.router.split(",")]
        else:
            watch = MachineWatch()
            decisions = record_decisions(engine.scheduler) if args.fidelity else []
            runs.append(drive(engine, w, policy))
            runs[-1].machine = {} if args.simulate else watch.report()
            runs[-1].decisions = decisions
            swapper = engine.scheduler.swapper
            if swapper and swapper.counters["bytes_to_host"]:  # what its copies measured
                info["link_bytes_per_s"] = swapper.bandwidth
        del engine
        free_device_memory()
    return runs, w, info


def free_device_memory() -> None:
    """Free the last engine before the next sizes its pool (torch's cache counts as used memory)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- fidelity: simulator beside engine


@dataclass
class Decision:
    """One schedule() that ran something: who got how many tokens, and what the policy saw."""

    at: float  # the engine's clock
    ran: dict  # request -> new tokens this step
    seen: dict  # request -> (status, output tokens, seconds until its reader runs dry)
    step_s: float  # the policy's estimate of a decode step of the running batch
    prefill_rate: float  # ...and of prompt tokens/s
    free_blocks: int
    batch: tuple[int, int, int]  # its prompt tokens, decodes and KV tokens (the cost model's terms)


def record_decisions(scheduler) -> list[Decision]:
    """Log scheduler's decisions from now on (the bench's own trace; the engine is unchanged)."""
    log, decide = [], scheduler.schedule

    def schedule():
        now = scheduler.clock()
        seen = {
            r: (r.status.value, r.num_output_tokens, r.dry_at - now)
            for r in itertools.chain(scheduler.running, scheduler.waiting)
        }
        step_s, free = scheduler.step_time(), scheduler.kv.num_free
        out = decide()
        if out:
            batch = (
                sum(n for _, n in out if n > 1),
                sum(n == 1 for _, n in out),
                sum(r.num_computed_tokens + n for r, n in out),
            )
            log.append(
                Decision(now, dict(out), seen, step_s, scheduler.rates.prefill_rate, free, batch)
            )
        return out

    scheduler.schedule = schedule
    return log


FIDELITY_METRICS = [
    ("TTFT p50 (s)", "ttft_p50"),
    ("TTFT p99 (s)", "ttft_p99"),
    ("rebuffer mean (s)", "rebuffer_mean"),
    ("QoE mean", "qoe_mean"),
    ("throughput (tok/s)", "throughput"),
    ("preemptions", "preemptions"),
]
REBUFFER_SLACK_S = 0.5  # rebuffer mean: within 15% or this many seconds (issue 40)


def fidelity_table(real: list[Run], sim: list[Run]) -> str:
    """Each metric on the engine and on the simulator, and the simulator's relative error."""
    lines = [["", *(f"{r.name} {side}" for r in real for side in ("real", "sim", "error"))]]
    for label, key in FIDELITY_METRICS:
        row = [label]
        for a, b in zip(real, sim):
            x, y = a.summary[key], b.summary[key]
            row += [f"{x:.3g}", f"{y:.3g}", f"{(y - x) / x:+.0%}" if x else "-"]
        lines.append(row)
    return aligned(lines)


def step_residual(run: Run, cost: CostModel) -> str:
    """How long the run's steps took, decision to decision, against what the cost model says of
    the same batches: the part of an engine's time that the simulator does not model."""
    pairs = zip(run.decisions, run.decisions[1:])
    spent = predicted = 0.0
    for a, b in pairs:
        spent += b.at - a.at
        predicted += cost.step_time(*a.batch)
    return (
        f"{run.name}: {len(run.decisions)} steps took {spent:.1f} s, the cost model says "
        f"{predicted:.1f} s for the same batches ({spent / max(predicted, 1e-9) - 1:+.0%})"
    )


def by_index(run: Run) -> dict:
    return {id(r): i for i, r in enumerate(run.requests)}


def first_parting(real: Run, sim: Run, shown: int = 8) -> str:
    """The first decision at which the two schedules differ, with the policy's inputs beside."""
    ri, si = by_index(real), by_index(sim)
    for k, (a, b) in enumerate(zip(real.decisions, sim.decisions)):
        ran_a = {ri[id(r)]: n for r, n in a.ran.items()}
        ran_b = {si[id(r)]: n for r, n in b.ran.items()}
        if ran_a == ran_b:
            continue
        seen_a = {ri[id(r)]: v for r, v in a.seen.items()}
        seen_b = {si[id(r)]: v for r, v in b.seen.items()}
        t0, t1 = real.start, sim.start
        lines = [
            f"{real.name}: the schedules part at decision {k} (real t={a.at - t0:.2f} s, "
            f"sim t={b.at - t1:.2f} s)",
            f"  step estimate real {a.step_s * 1e3:.0f} ms, sim {b.step_s * 1e3:.0f} ms; "
            f"prefill rate real {a.prefill_rate:.0f}, sim {b.prefill_rate:.0f} tok/s; "
            f"free blocks real {a.free_blocks}, sim {b.free_blocks}",
            "  request: real (state, output tokens, s to dry, tokens run) | sim (same)",
        ]
        differ = sorted(i for i in seen_a.keys() | seen_b.keys() if ran_a.get(i) != ran_b.get(i))
        for i in differ[:shown]:
            lines.append(
                f"  #{i}: {seen_side(seen_a.get(i), ran_a.get(i))} | "
                f"{seen_side(seen_b.get(i), ran_b.get(i))}"
            )
        if len(differ) > shown:
            lines.append(f"  ... and {len(differ) - shown} more")
        return "\n".join(lines)
    common = min(len(real.decisions), len(sim.decisions))
    return (
        f"{real.name}: the same {common} decisions (the engine made {len(real.decisions)}, "
        f"the simulator {len(sim.decisions)})"
    )


def seen_side(seen: tuple | None, ran: int | None) -> str:
    if seen is None:
        return "not there"
    status, tokens, dry = seen
    return f"{status}, {tokens}, {dry:+.2f}, {ran or 0}"


def fit_cost_model(args: argparse.Namespace) -> CostModel:
    """The simulator's cost model, fitted to this engine now (bench.py --calibrate's fit)."""
    options = {"device": args.device, "dtype": args.dtype, "cpu_threads": args.cpu_threads}
    fit = calibrate(LLM(args.ckpt, **options))
    free_device_memory()
    return fit


def replay(args: argparse.Namespace, w: Workload, info: dict, fit: CostModel) -> list[Run]:
    """The real runs' workload on the simulator with `fit`, their KV pools and policy order."""
    link = info.get("link_bytes_per_s", fit.link_bytes_per_s)  # the copies of the real runs
    cost = dataclasses.replace(fit, num_kv_blocks=info["kv_blocks"], link_bytes_per_s=link)
    host_kv_gb = EngineConfig.host_kv_gb if args.host_kv_gb is None else args.host_kv_gb
    sim_args = argparse.Namespace(
        **{
            **vars(args),
            "simulate": True,
            "preset": cost,
            "num_kv_blocks": info["kv_blocks"],
            "host_kv_gb": host_kv_gb,
        }
    )
    sim, _, _ = run_policies(sim_args, w)
    for run in sim:
        run.ttft_slo = ttft_slo(args)
    return sim


def fidelity(args: argparse.Namespace) -> None:
    """Fit the cost model on this engine, run the workload on the engine, replay it on the
    simulator with that fit, per policy: the simulator's error and where the schedules part."""
    args.prompt_len = args.prompt_len or "64:16"
    fit = fit_cost_model(args)
    real, w, info = run_policies(args, build_workload(args))
    for run in real:
        run.ttft_slo = ttft_slo(args)
    sim = replay(args, w, info, fit)
    print(f"workload: {w.source}; seed {args.seed}; readers {args.read_rate}")
    print(f"engine: {info['engine']}; compute: {info['threads']}")
    print(f"fitted in this run: {fit.describe()}")
    if "link_bytes_per_s" in info:
        print(f"the engine's copies measured {info['link_bytes_per_s'] / 1e9:.2g} GB/s")
    print(fidelity_table(real, sim))
    for a, b in zip(real, sim):
        print(first_parting(a, b))
    for run in real:
        print(step_residual(run, fit))
    for run in real:
        print(describe_machine(run.name, run.machine))
    if args.json:
        rows = {
            r.name: {"real": r.summary, "sim": s.summary, "machine": r.machine}
            for r, s in zip(real, sim)
        }
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": {**vars(args), "tokenflow": None},
                    "fit": fit.describe(),
                    "policies": rows,
                },
                indent=2,
                default=str,
            )
        )


# ---------------------------------------------------------------- the real engine's regimes


# Each row on the demo model and the CPU: readers at 8 tok/s ask ~1/3, ~1.3x and ~3x of what a
# 2-core engine makes (~100 tok/s at the batch its memory holds); a fit in the same run replays
# each row on the simulator. A row's runs take ~10-40 s per policy on 2 cores.
REGIMES_BASE = "--read-rate 8 --seed 0 --prompt-len 64:8 --output-len 96:16"
REGIMES = [
    ("burst 4 (1/3 of capacity)", "--burst 4 --kv-frac 1"),
    ("burst 16 (1.3x)", "--burst 16 --kv-frac 1"),
    ("burst 32 (3x)", "--burst 32 --kv-frac 1"),
    ("burst 16 (1.3x), memory for a third", "--burst 16 --kv-frac 0.33"),
    ("burst 32 (3x), memory for 9 (issue 40)", "--burst 32 --prompt-len 45:2 --output-len 128:0"),
    ("poisson 0.3/s (1/3)", "--poisson 0.3 --duration 20"),
    ("poisson 1.4/s (1.3x)", "--poisson 1.4 --duration 15"),
    (
        "multi-turn chat",
        "--multi-turn 6 --turns 3 --think-time 2 --prompt-len 256:32 "
        "--output-len 32:8 --read-rate 20",
    ),
    ("long prompts", "--burst 6 --prompt-len 1024:64 --output-len 32:8"),
]
REGIME_METRICS = [
    ("TTFT p99", "ttft_p99", 1),
    ("rebuffer mean", "rebuffer_mean", 1),
    ("QoE mean", "qoe_mean", -1),
    ("throughput", "throughput", -1),
]
SIM_ERRORS = [
    ("TTFT p50", "ttft_p50"),
    ("TTFT p99", "ttft_p99"),
    ("throughput", "throughput"),
    ("rebuffer", "rebuffer_mean"),
]
SIM_TOLERANCE = 0.15  # issue 40: the simulator within 15% of the engine (rebuffer: or 0.5 s)


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3g} ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else f"{mean:.3g}"


def regime_verdict(name: str, fcfs: list[dict], tokenflow: list[dict]) -> list[str]:
    """What tokenflow loses against fcfs beyond the spread of fcfs's own repeats; TTFT p99 must
    be better in a burst row."""
    misses = []
    for label, key, sign in REGIME_METRICS:
        ours, theirs = [s[key] for s in tokenflow], [s[key] for s in fcfs]
        noise = max(theirs) - min(theirs)
        if sign * (statistics.mean(ours) - statistics.mean(theirs)) > noise + 1e-9:
            misses.append(label)
    burst = name.startswith("burst")
    if burst and statistics.mean(s["ttft_p99"] for s in tokenflow) >= statistics.mean(
        s["ttft_p99"] for s in fcfs
    ):
        misses.append("TTFT p99 not better")
    return misses


def sim_errors(real: list[dict], sim: dict) -> tuple[str, int]:
    """The simulator's error against the mean of the engine's repeats, and how many are within
    tolerance (rebuffer: 15%, or 0.5 s, or the engine's own spread)."""
    parts, within = [], 0
    for label, key in SIM_ERRORS:
        values = [s[key] for s in real]
        mean = statistics.mean(values)
        error = (sim[key] - mean) / mean if mean else 0.0
        slack = max(REBUFFER_SLACK_S, max(values) - min(values)) if key == "rebuffer_mean" else 0
        within += abs(error) <= SIM_TOLERANCE or abs(sim[key] - mean) <= slack
        parts.append(f"{label} {error:+.0%}")
    return ", ".join(parts), within


def regimes(args: argparse.Namespace) -> None:
    """The real engine's regime set: each row under both policies, --repeat K times (the policy
    order alternating), and the simulator with a cost model fitted in the same run beside it."""
    fit = fit_cost_model(args)
    print(f"fitted in this run: {fit.describe()}")
    print(
        "| regime | TTFT p99 s | rebuffer mean s | QoE mean | throughput tok/s | verdict | "
        "simulator's error (fcfs; tokenflow) |\n" + "|---" * 7 + "|"
    )
    results = []
    own = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in (
            ("ckpt", args.ckpt),
            ("device", args.device),
            ("cpu_threads", args.cpu_threads),
        )
        if v
    ]
    for name, extra in (row for row in REGIMES if args.regimes in row[0]):
        real = {"fcfs": [], "tokenflow": []}
        for k in range(max(2, args.repeat)):
            order = "fcfs,tokenflow" if k % 2 == 0 else "tokenflow,fcfs"
            row = parse_args(f"{REGIMES_BASE} {extra} --policies {order}".split() + own)
            runs, w, info = run_workload(row)
            for run in runs:
                real[run.name].append({**run.summary, **run.machine})
        sim = {r.name: r.summary for r in replay(row, w, info, fit)}
        errors = [sim_errors(real[p], sim[p]) for p in ("fcfs", "tokenflow")]
        misses = regime_verdict(name, real["fcfs"], real["tokenflow"])
        cells = [
            f"{spread([s[key] for s in real['fcfs']])} -> "
            f"{spread([s[key] for s in real['tokenflow']])}"
            for _, key, _ in REGIME_METRICS
        ]
        quiet = max(s["others_cpu_share"] for p in real.values() for s in p) <= NOT_QUIET_SHARE
        verdict_text = "pass" if not misses else "misses: " + ", ".join(misses)
        verdict_text += "" if quiet else " (not quiet)"
        print(
            f"| {name} | {' | '.join(cells)} | {verdict_text} | {errors[0][0]}; {errors[1][0]} |",
            flush=True,
        )
        results.append(
            {
                "regime": name,
                "real": real,
                "sim": sim,
                "misses": misses,
                "sim_within": [e[1] for e in errors],
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"fit": fit.describe(), "rows": results}, indent=2))


# ---------------------------------------------------------------- output


ROWS = [
    ("TTFT mean (s)", "ttft_mean", "{:.2f}"),
    ("TTFT p50 (s)", "ttft_p50", "{:.2f}"),
    ("TTFT p99 (s)", "ttft_p99", "{:.2f}"),
    ("TBT p99 (s)", "tbt_p99", "{:.3f}"),
    ("rebuffer mean (s)", "rebuffer_mean", "{:.2f}"),
    ("rebuffer p99 (s)", "rebuffer_p99", "{:.2f}"),
    ("QoE mean", "qoe_mean", "{:.3f}"),
    ("QoE >= 0.95 share", "qoe_good_share", "{:.0%}"),
    ("TTFT <= SLO share", "ttft_slo_share", "{:.0%}"),
    ("effective throughput (tok/s)", "effective_throughput", "{:.1f}"),
    ("throughput (tok/s)", "throughput", "{:.1f}"),
    ("makespan (s)", "makespan", "{:.1f}"),
    (
        "preemptions (resumed by load/recompute)",
        "preemptions",
        "{preemptions} ({resumes_load}/{resumes_recompute})",
    ),
    ("GB moved host<->device", "gb", "{:.2f}"),
    ("prefix hits (device + host)", "prefix", "{device_hits:.1%} + {host_hits:.1%}"),
    ("requests completed", "completed", "{:.0f}"),
]


def shown(s: dict) -> dict:
    queried = max(1, s["prefix_queried_tokens"])
    hits = (s["prefix_hit_tokens"], s["prefix_host_hit_tokens"])
    return {
        **s,
        "gb": (s["bytes_to_host"] + s["bytes_to_device"]) / 1e9,
        "prefix": sum(hits) / queried,
        "device_hits": hits[0] / queried,
        "host_hits": hits[1] / queried,
    }


def aligned(lines: list[list[str]]) -> str:
    """Rows of cells as text columns: the first left-aligned, the rest right-aligned."""
    widths = [max(map(len, column)) for column in zip(*lines)]
    return "\n".join(
        "  ".join(
            c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(row, widths))
        )
        for row in lines
    )


def table(runs: list[Run]) -> str:
    sums = list(map(shown, (r.summary for r in runs)))
    ratio = [f"{runs[-1].name}/{runs[0].name}"] if len(runs) == 2 else []
    lines = [[""] + [r.name for r in runs] + ratio]
    for label, key, fmt in ROWS:
        ratio = [f"{sums[-1][key] / sums[0][key]:.2f}x" if sums[0][key] else "-"] if ratio else []
        lines.append([label] + [fmt.format(s[key], **s) for s in sums] + ratio)
    return aligned(lines)


def plot(runs: list[Run], path: str) -> None:
    """Each request's buffer over time, per policy, and the TTFT CDF of every policy."""
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(6 * (len(runs) + 1), 4.5))
    for ax in axes[1:-1]:
        ax.sharey(axes[0])
    for ax, run in zip(axes, runs):
        for r in run.records:  # unread tokens at every generation and read
            curve = levels(r.token_times, read_times(r.token_times, r.rate))
            ax.step(
                [t - run.start for t, _ in curve],
                [n for _, n in curve],
                lw=0.5,
                alpha=0.4,
                where="post",
            )
        ax.set(
            title=f"{run.name}: each request's buffer", xlabel="time (s)", ylabel="unread tokens"
        )
    for run in runs:
        ttfts = sorted(r.ttft for r in run.records if r.token_times)
        axes[-1].step(
            ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=run.name
        )
    axes[-1].axvline(TTFT_TARGET, color="gray", ls=":", label=f"{TTFT_TARGET} s")
    axes[-1].set(title="TTFT CDF", xlabel="TTFT (s)", ylabel="share of requests")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- the regime matrix


MATRIX_BASE = (
    "--simulate --preset h200-llama3-8b --prompt-len 512 --output-len 2048 --read-rate 20 --seed 0"
)
TRACE = Path(__file__).parent / "data" / "azure_code_burst_10min.csv"
MIX = "--read-rate 15:0.4,20:0.6"
MATRIX = [  # (name, arguments added to MATRIX_BASE[, targets beyond the bar])
    ("burst 400", "--burst 400", {"ttft_p99": 0.15, "effective_throughput": 1.6}),
    ("burst 400, interval 0.5 s", "--burst 400 --tokenflow interval=0.5"),
    ("burst 200, long outputs", "--burst 200 --prompt-len 1024 --output-len 4096 --read-rate 25"),
    ("burst 64", "--burst 64"),
    *[(f"poisson {rate}/s", f"--poisson {rate} --duration 60") for rate in (2, 5, 7, 10)],
    ("poisson 20/s (overload)", "--poisson 20 --duration 60"),
    ("tight memory (400 blocks)", "--burst 400 --num-kv-blocks 400"),
    (
        "long prompts, short outputs",
        "--burst 200 --prompt-len 8000:100 --output-len 64:16 --read-rate 5",
    ),
    ("slow readers (5 tok/s)", "--burst 400 --read-rate 5"),
    ("fast readers (40 tok/s)", "--burst 400 --read-rate 40"),
    ("faster readers (60 tok/s)", "--burst 400 --read-rate 60"),
    (
        "burst 400, readers 1.25x the mix",
        "--burst 400 --read-rate 18.75:0.4,25:0.6",
        {"ttft_p99": 0.3},
    ),
    ("poisson 30/s (1.5x overload)", "--poisson 30 --duration 60"),
    ("reader mix 15:0.4,20:0.6", f"--burst 400 {MIX}"),
    ("azure code trace", f"--trace {TRACE} {MIX}"),
    ("azure code trace x4 speed", f"--trace {TRACE} --time-scale 0.25 {MIX}"),
]
REPEAT_JITTER = 0.03  # --matrix --repeat: step times vary by up to 3% (uniformly), as on a GPU
# the bar, every row: (metric, tokenflow at most (+1) or at least (-1), factor of fcfs, plus)
BAR = [
    ("ttft_p99", 1, 1.1, 0.2),
    ("rebuffer_mean", 1, 1.1, 0.1),
    ("throughput", -1, 0.95, 0.0),
    ("effective_throughput", -1, 0.95, 0.0),
]
MATRIX_HEAD = (
    "| regime | TTFT p99 s | rebuffer mean s | eff. throughput | throughput | "
    "QoE >= 0.95 share | TTFT <= SLO share | verdict |\n" + "|---" * 8 + "|"
)


def verdict(fcfs: dict, tokenflow: dict, targets: dict[str, float]) -> list[str]:
    """What tokenflow misses of the bar (and of the row's targets) against fcfs; empty = pass."""
    misses = [
        f"{s['completed']}/{s['requests']} completed ({name})"
        for name, s in (("fcfs", fcfs), ("tokenflow", tokenflow))
        if s["completed"] != s["requests"]
    ]
    rules = BAR + [(key, 1 if ratio < 1 else -1, ratio, 0.0) for key, ratio in targets.items()]
    for key, sign, factor, plus in rules:
        limit = factor * fcfs[key] + sign * plus
        if sign * (tokenflow[key] - limit) > 1e-9:
            misses.append(f"{key} {tokenflow[key]:.3g} {'>' if sign > 0 else '<'} {limit:.3g}")
    return misses


def run_matrix(rows: list[tuple[str, str, dict]], base: str = MATRIX_BASE):
    """Every row under both policies; yields (name, fcfs summary, tokenflow summary, misses)."""
    for name, extra, *targets in rows:
        runs, _, _ = run_workload(parse_args(f"{base} {extra} --policies fcfs,tokenflow".split()))
        fcfs, tokenflow = (r.summary for r in runs)
        yield name, fcfs, tokenflow, verdict(fcfs, tokenflow, dict(*targets))


def matrix_row(name: str, f: dict, t: dict, misses: list[str], runs: str = "") -> str:
    """One markdown row: fcfs -> tokenflow for the bar's metrics, and the verdict."""
    ratio = lambda key: f"{t[key] / f[key]:.2f}x" if f[key] else "-"  # noqa: E731
    verdict = "pass" if not misses else "FAIL: " + "; ".join(misses)
    verdict = f"{runs}; worst run: {verdict}" if runs else verdict
    return (
        f"| {name} | {f['ttft_p99']:.2f} -> {t['ttft_p99']:.2f} | {f['rebuffer_mean']:.2f} -> "
        f"{t['rebuffer_mean']:.2f} | {ratio('effective_throughput')} | {ratio('throughput')} | "
        f"{f['qoe_good_share']:.0%} -> {t['qoe_good_share']:.0%} | "
        f"{f['ttft_slo_share']:.0%} -> {t['ttft_slo_share']:.0%} | {verdict} |"
    )


def sched_cost(sizes: tuple[int, ...] = (256, 1024, 4096), steps: int = 200) -> None:
    """Median CPU time (this process's, robust to a shared machine's neighbours) of one schedule()
    call, of a full rebalance and of after_step() with N requests running and N/8 waiting
    (simulator). The baseline admits them all (tokenflow admits only what the modelled H200 can
    serve: ~38k tok/s at 4096), then the policy timed takes over. Readers read 20 tok/s."""
    print(
        f"{'policy':>10} {'running':>8} {'ms per decision':>16} {'ms per rebalance':>16} "
        f"{'ms after step':>14}"
    )
    for policy, n in itertools.product(POLICIES, sizes):
        params = SamplingParams(max_tokens=4096, ignore_eos=True, read_rate=20)
        engine = build_engine("h200-llama3-8b", "fcfs", num_kv_blocks=n * 300)
        s = engine.scheduler
        s.max_num_seqs, s.max_num_batched_tokens = n, n + 2048  # a token for each, and prompts
        for _ in range(n + n // 8):
            engine.add_request([1] * 64, params)
        while len(s.running) < n:  # prefill everyone that fits
            engine.step()
        s.policy = make_policy(policy)
        for _ in range(20):  # a few decodes, so that readers have buffers
            engine.step()
        deciding, after = [], []
        for _ in range(steps):
            deciding.append(seconds(s.schedule, time.process_time))
            engine.clock.advance_to(engine.clock() + 0.01)
            for req in s.running:  # what the step would have done: one more token each
                req.num_computed_tokens = req.num_tokens
                req.append(0, engine.clock())
            after.append(seconds(lambda: s.after_step(0.01, 0, len(s.running)), time.process_time))
        rebalance = "-"
        if isinstance(s.policy, TokenFlow):  # a full rebalance (working set, sort, fill, victims)
            now = engine.clock()
            spent = [seconds(lambda: full_rebalance(s, now), time.process_time) for _ in range(10)]
            rebalance = f"{statistics.median(spent) * 1e3:.3f}"
        print(
            f"{policy:>10} {n:>8} {statistics.median(deciding) * 1e3:>16.3f} {rebalance:>16} "
            f"{statistics.median(after) * 1e3:>14.3f}"
        )


def full_rebalance(s, now: float) -> None:
    s.policy.last_rebalance = float("-inf")
    s.policy.preemptions(s, now)


# ---------------------------------------------------------------- GPU: --gpu-check and its parts


GPU_CHECK_BURST = 32  # requests in --gpu-check's burst: both policies in about a minute on a GPU
GPU_CHECK_JSON = "gpu-check.json"
KERNEL_BATCHES, KERNEL_CONTEXTS = (1, 32, 128), (512, 2048, 8192)  # decode speed: the same batches
WARMUP, ITERS = 3, 10
L2_FLUSH_BYTES = 256 << 20  # written before each timed call, so small inputs are not served from L2
COPY_BYTES = 1 << 30
TRANSFER_BYTES = 2 << 30  # KV moved per transfer measurement
DECODE_BATCH, DECODE_CONTEXT = 64, 1024


def cuda_time(fn) -> float:
    """Median seconds of one call of fn on the current stream, L2 flushed before each call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(WARMUP):
        fn()
    events = [[torch.cuda.Event(enable_timing=True) for _ in "se"] for _ in range(ITERS)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def seconds(fn, clock=time.perf_counter) -> float:
    """Seconds of one call of fn: wall-clock, or this process's CPU time (time.process_time)."""
    start = clock()
    fn()
    return clock() - start


def copy_bandwidth() -> float:
    """Bytes/s (read + write) of one big device-to-device copy: what other rates are held to."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / cuda_time(lambda: dst.copy_(src))


def bench_kernels() -> dict:
    """Decode attention at Llama-3-8B shapes, in bytes/s next to a plain device-to-device copy."""
    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    peak, rows = copy_bandwidth(), []
    print(f"device copy bandwidth: {peak / 1e9:.0f} GB/s (read + write)")
    print(f"{'batch':>5} {'context':>7} {'time us':>9} {'GB/s':>7} {'of copy':>7}")
    for batch, context in itertools.product(KERNEL_BATCHES, KERNEL_CONTEXTS):
        blocks = batch * context // BLOCK_SIZE  # each block in one sequence, in random order
        pool = torch.randn(blocks, 2, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device="cuda")
        tables = torch.randperm(blocks, device="cuda").view(batch, -1).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
        s = cuda_time(
            lambda: decode_attention_triton(
                q, pool[:, 0], pool[:, 1], tables, lens, context, head_dim**-0.5
            )
        )
        nbytes = (pool.numel() + 2 * q.numel()) * q.element_size()  # K + V, q and the output
        share = nbytes / s / peak
        print(f"{batch:>5} {context:>7} {s * 1e6:>9.1f} {nbytes / s / 1e9:>7.0f} {share:>7.0%}")
        rows.append(dict(batch=batch, context=context, seconds=s, share_of_copy=share))
    worst = min(r["share_of_copy"] for r in rows if r["batch"] >= 32 and r["context"] >= 2048)
    return dict(
        copy_bytes_per_s=peak,
        rows=rows,
        summary=f"decode kernel >= {worst:.0%} of copy "
        "bandwidth at batch >= 32, context >= 2k (target 70%)",
    )


def llama_pool(num_blocks: int, device: str, host: bool = False) -> KVPool:
    return KVPool(
        num_blocks,
        LLAMA3_8B.num_hidden_layers,
        BLOCK_SIZE,
        LLAMA3_8B.num_key_value_heads,
        LLAMA3_8B.head_dim,
        torch.bfloat16,
        torch.device(device),
        host=host,
    )


def llama_swapper(num_blocks: int, device: str = "cuda") -> Swapper:
    return Swapper(llama_pool(num_blocks, device), llama_pool(num_blocks, device, host=True))


def fake_request(block_table: list[int], num_computed_tokens: int) -> SimpleNamespace:
    """What the Swapper reads of a request."""
    return SimpleNamespace(
        block_table=block_table,
        host_block_table=[],
        num_host_tokens=0,
        num_computed_tokens=num_computed_tokens,
        block_hashes=[],
    )


def swapper_bandwidth(sw: Swapper) -> tuple[float, float]:
    """Bytes/s of evicting every device block, scattered, to host, and of loading them all back."""
    blocks = sw.device.num_blocks
    sw.device.free_blocks = deque(random.sample(range(blocks), blocks))
    req = fake_request([], blocks * BLOCK_SIZE)
    sw.device.grow(req.block_table, req.num_computed_tokens)
    # forget the host copy first, so that every block is copied again
    evict = lambda: (sw.forget(req), sw.evict(req), sw.complete_all())  # noqa: E731
    load = lambda: (sw.load(req), sw.complete_all(), torch.cuda.synchronize())  # noqa: E731
    rounds = [(seconds(evict), seconds(load)) for _ in range(1 + ITERS // 2)][1:]  # 1st: warm-up
    return tuple(blocks * sw.block_bytes / statistics.median(t) for t in zip(*rounds))


def bench_transfers() -> dict:
    """The Swapper's copies against one raw pinned copy_; decode beside write-through."""
    block_bytes = BLOCK_SIZE * kv_bytes_per_token(LLAMA3_8B, torch.bfloat16)
    sw = llama_swapper(TRANSFER_BYTES // block_bytes)
    nbytes = sw.device.num_blocks * sw.block_bytes
    ours = swapper_bandwidth(sw)
    del sw
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = (
        nbytes / cuda_time(lambda: pinned.copy_(dev, non_blocking=True)),
        nbytes / cuda_time(lambda: dev.copy_(pinned, non_blocking=True)),
    )
    print(
        f"{nbytes / 1e9:.1f} GB of Llama-3-8B KV in {BLOCK_SIZE}-token blocks, scattered, vs "
        f"one pinned copy_\n{'direction':>13} {'Swapper GB/s':>13} {'raw GB/s':>9} {'share':>6}"
    )
    for name, x, y in zip(("device->host", "host->device"), ours, raw):
        print(f"{name:>13} {x / 1e9:>13.1f} {y / 1e9:>9.1f} {x / y:>6.0%}")
    shares = (ours[0] / raw[0], ours[1] / raw[1])
    slowdown = bench_decode_beside_write_through()
    return dict(
        to_host_share=shares[0],
        to_device_share=shares[1],
        write_through_slowdown=slowdown,
        summary=f"swap {min(shares):.0%} of a raw pinned copy (target 80%); write-through "
        f"slows decode by {slowdown:.1%} (target <= 5%)",
    )


def random_model(device: str) -> Transformer:
    """Llama-3-8B's shape with random bf16 weights: timing needs no checkpoint."""
    with torch.device("meta"):
        model = Transformer(LLAMA3_8B).to(torch.bfloat16)
    model.to_empty(device=device)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.inv_freq = rope_inv_freq(LLAMA3_8B).to(device)
    return model.eval()


def decode_forward(
    model: Transformer, pool: KVPool, batch: int, context: int, graphs: bool = False
):
    """A decode step's forward over `batch` sequences of `context` tokens, and their tables."""
    device, per_seq = pool.kv_cache.device, context // BLOCK_SIZE
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta, positions = build_metadata(
        tables, [context - 1] * batch, [1] * batch, batch, BLOCK_SIZE, device
    )
    ids = torch.randint(model.config.vocab_size, (batch,), device=device)
    rows, caches = torch.arange(batch, device=device), pool.layer_caches()
    if graphs:
        runner = DecodeGraphs(
            model, caches, [batch], model.config.max_position_embeddings, BLOCK_SIZE, capture=True
        )
        return (lambda: runner.run(ids, positions, meta)), tables
    return (lambda: model(ids, positions, caches, meta, rows)), tables


def bench_decode_speed(device: str = "cuda") -> dict:
    """Decode tokens/s of a random Llama-3-8B in bf16 at each batch, against its bandwidth floor:
    the weights and the batch's KV read once per step at the measured copy rate."""
    model, peak, rows = random_model(device), copy_bandwidth(), []
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for batch, mode in itertools.product(KERNEL_BATCHES, ("eager", "graphs")):
        pool = llama_pool(batch * DECODE_CONTEXT // BLOCK_SIZE, device)
        floor = (weights + pool.kv_cache.numel() * pool.kv_cache.element_size()) / peak
        s = cuda_time(decode_forward(model, pool, batch, DECODE_CONTEXT, mode == "graphs")[0])
        rows.append(
            dict(
                batch=batch,
                context=DECODE_CONTEXT,
                mode=mode,
                tokens_per_s=batch / s,
                share_of_floor=floor / s,
            )
        )
        print(
            f"decode batch {batch:>3}, {mode}: {batch / s:>8.0f} tok/s, {floor / s:.0%} of the "
            "bandwidth floor"
        )
        del pool
        free_device_memory()
    shares = [f"batch {r['batch']} {r['mode']} {r['share_of_floor']:.0%}" for r in rows]
    return dict(
        rows=rows,
        summary=f"share of the bandwidth floor: {', '.join(shares)} (target: "
        "batch 1 with graphs >= 90%)",
    )


def bench_decode_beside_write_through(device: str = "cuda") -> float:
    """One decode step at batch 64, alone and right after a step's write-through is queued."""
    sw = llama_swapper(DECODE_BATCH * DECODE_CONTEXT // BLOCK_SIZE, device)
    forward, tables = decode_forward(random_model(device), sw.device, DECODE_BATCH, DECODE_CONTEXT)
    reqs = [fake_request(t, DECODE_CONTEXT - 1) for t in tables]
    # the compute stream only: copies may still be running
    step = lambda: (forward(), torch.cuda.current_stream().synchronize())  # noqa: E731

    def write_through_then_step() -> float:
        sw.complete_all()
        for r in reqs:
            sw.forget(r)  # so that there is always something to write
        return seconds(lambda: (sw.write_through(reqs, max_blocks), step()))  # as the engine does

    alone = statistics.median(seconds(step) for _ in range(ITERS))
    max_blocks = max(1, int(alone * sw.bandwidth / sw.block_bytes))  # as Scheduler.after_step
    beside = statistics.median(write_through_then_step() for _ in range(ITERS))
    print(
        f"decode step, Llama-3-8B shape, batch {DECODE_BATCH}, context {DECODE_CONTEXT}: "
        f"{alone * 1e3:.1f} ms alone; {beside * 1e3:.1f} ms with a write-through of {max_blocks} "
        f"blocks ({max_blocks * sw.block_bytes / 1e6:.0f} MB) queued before it"
    )
    return beside / alone - 1


def run_cuda_tests() -> dict:
    """The test suite's `cuda`-marked tests, compiled kernels on the real device."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "test_all.py"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    last = (out.stdout.strip().splitlines() or ["no output"])[-1]
    if out.returncode != 0:
        raise RuntimeError(f"{last}\n{out.stdout[-3000:]}")
    return dict(summary=last)


def burst_check(args: argparse.Namespace) -> dict:
    """Both policies on a short burst (the checkpoint of --ckpt, else the demo model)."""
    args.burst = args.burst or GPU_CHECK_BURST
    runs, w, info = run_workload(args)
    print(table(runs))
    f, t = (r.summary for r in runs)
    gain = t["effective_throughput"] / f["effective_throughput"]
    return dict(
        policies={r.name: r.summary for r in runs},
        engine=info["engine"],
        summary=f"TTFT p99 {f['ttft_p99']:.2f} -> {t['ttft_p99']:.2f} s, effective "
        f"throughput {gain:.2f}x (fcfs -> tokenflow, {len(w)} requests)",
    )


def gpu_check(args: argparse.Namespace) -> dict:
    """--gpu-check's steps in order, or --kernels and --transfers; GPU steps skip without one."""
    steps = {
        "cuda tests": run_cuda_tests,
        "kernels": bench_kernels,
        "transfers": bench_transfers,
        "decode": bench_decode_speed,
        "burst": lambda: burst_check(args),
    }
    results = {}
    flagged = [n for n in ("kernels", "transfers") if getattr(args, n)]
    for name in list(steps) if args.gpu_check else flagged:
        print(f"== {name}", flush=True)
        try:
            if name != "burst" and not torch.cuda.is_available():
                results[name] = dict(status="skipped", summary="needs a CUDA GPU; none here")
            else:
                results[name] = dict(status="ran", **steps[name]())
        except Exception as e:  # noqa: BLE001 (one step's failure must not hide the others')
            summary = f"{type(e).__name__}: {e}".splitlines()[0]
            results[name] = dict(status="failed", summary=summary, error=str(e))
        free_device_memory()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    report = dict(device=f"{device}, {os.cpu_count()} CPUs", torch=torch.__version__, steps=results)
    path = args.json or (GPU_CHECK_JSON if args.gpu_check else None)
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{', '.join(results)} on {report['device']} (torch {torch.__version__}); JSON: {path}")
    print("| step | status | result |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['status']} | {r['summary']} |")
    return report


# ---------------------------------------------------------------- the command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    work = ap.add_mutually_exclusive_group().add_argument
    work("--burst", type=int, metavar="N", help="N requests, all arriving at t=0")
    work("--poisson", type=float, metavar="RATE", help="Poisson arrivals, RATE requests/s")
    work(
        "--trace",
        metavar="FILE",
        help="replay a CSV of arrival_s,prompt_tokens,output_tokens "
        f"(data/azure_code_burst_10min.csv: the {TRACE_CREDIT}) or a Mooncake JSONL",
    )
    work("--multi-turn", type=int, metavar="N", help="N conversations of --turns turns each")
    add("--turns", type=int, default=3, help="--multi-turn: turns per conversation (default: 3)")
    add("--think-time", type=float, default=5.0, help="--multi-turn: mean s before a next turn")
    add(
        "--trace-block",
        type=int,
        default=TRACE_BLOCK,
        help="tokens per Mooncake hash id; "
        "prompt lengths scale along (default: %(default)s, as recorded)",
    )
    add("--conversations", type=int, metavar="K", help="replay a Mooncake trace's first K chats")
    add("--duration", type=float, default=60.0, help="s of Poisson arrivals (default: 60)")
    add("--time-scale", type=float, default=1.0, help="multiply trace arrival times by this")
    add("--prompt-len", help="prompt (--multi-turn: message) tokens MEAN[:SPREAD] (default: 64:16)")
    add("--output-len", default="128:32", help="output tokens, MEAN[:SPREAD] (default: 128:32)")
    add(
        "--read-rate",
        default="auto",
        help=f"readers' tokens/s: RATE[:SHARE],... ({PAPER_MIX} "
        "is the paper's) or auto: the paper's mix scaled to the measured engine (default: auto)",
    )
    add(
        "--ttft-slo",
        type=float,
        metavar="S",
        help="the TTFT SLO whose attainment is reported "
        f"(default: {TTFT_SLO} s on a GPU or its simulation, {TTFT_SLO * CPU_SLO_SCALE} on a CPU)",
    )
    add("--seed", type=int, default=0, help="seeds arrivals, lengths and rates (default: 0)")
    add("--policies", default="fcfs,tokenflow", help="run in turn (default: %(default)s)")
    add("--simulate", action="store_true", help="a simulated engine on a virtual clock (sim.py)")
    add(
        "--preset",
        default="h200-llama3-8b",
        choices=PRESETS,
        metavar="NAME",
        help="--simulate's cost model: %(choices)s (default: %(default)s)",
    )
    add("--replicas", type=int, metavar="N", help="--simulate N replicas behind --router")
    add(
        "--router",
        default="least-queue",
        help=f"--replicas: {', '.join(ROUTERS)}, or several "
        "with commas, each run in turn (default: %(default)s)",
    )
    add(
        "--find-replicas",
        action="store_true",
        help="--replicas: search the fewest replicas "
        f"where {GOOD_SHARE * 100:.0f}%% of requests reach QoE >= 0.95, from --replicas up or down",
    )
    add(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="--replicas: s between the router's scrapes of /metrics (default: %(default)s)",
    )
    add("--uncharged", action="store_true", help="--simulate: scheduler CPU time off the clock")
    add(
        "--jitter",
        type=float,
        default=0.0,
        metavar="F",
        help="--simulate: each step's time "
        f"times a random factor in [1-F, 1+F] (default: 0; {REPEAT_JITTER} with --repeat)",
    )
    add("--jitter-seed", type=int, default=0, help="seeds --jitter (default: 0)")
    add(
        "--repeat",
        type=int,
        default=1,
        metavar="K",
        help="--matrix: each row K times (jitter "
        "seeds 0..K-1): its worst run and how many of K pass",
    )
    add("--calibrate", action="store_true", help="fit a cost model to this engine and print it")
    add(
        "--fidelity",
        action="store_true",
        help="the workload on this engine and on the "
        "simulator with a cost model fitted in the same run: the simulator's error per metric",
    )
    add(
        "--regimes",
        nargs="?",
        const="",
        metavar="FILTER",
        help="the real engine's regime set "
        "(FILTER: by name), both policies, --repeat K (default 2) with the order alternating, "
        "beside the simulator fitted in the same run",
    )
    add("--http", metavar="URL", help="send the workload to a running server (nanoflow.serve)")
    add("--ckpt", help="checkpoint folder or .gguf (default: the demo model)")
    EngineConfig.add_flags(ap, ENGINE_FLAGS)
    add(
        "--kv-frac",
        type=float,
        help="device KV pool: share of the workload at full length "
        f"(default: {DEFAULT_KV_FRAC} for --burst and --poisson, else all memory)",
    )
    add(
        "--host-kv-gb",
        type=float,
        help="host memory (GiB) for swapped-out and cached KV "
        f"(default: {EngineConfig.host_kv_gb}; --simulate: the preset's)",
    )
    add("--context", type=int, default=8192, help="--http: clamp lengths to this (default: 8192)")
    add("--json", metavar="PATH", help="write the config and each policy's metrics as JSON")
    add("--plot", metavar="PATH", help="write a PNG of buffers over time and TTFT CDFs")
    add("--kernels", action="store_true", help="time the decode attention kernel (GPU only)")
    add("--transfers", action="store_true", help="time KV swaps and write-through (GPU only)")
    add("--gpu-check", action="store_true", help="cuda tests, kernels, transfers, decode, burst")
    add(
        "--matrix",
        nargs="?",
        const="",
        metavar="FILTER",
        help="--simulate the regimes (FILTER: by name) under both policies: a verdict per row",
    )
    add("--sched-cost", action="store_true", help="time a decision at 256, 1024 and 4096 running")
    args = ap.parse_args(argv)
    workload = (args.burst, args.poisson, args.trace, args.multi_turn)
    modes = (args.gpu_check, args.kernels, args.transfers, args.sched_cost, args.calibrate)
    if not (any(workload) or args.matrix is not None or args.regimes is not None or any(modes)):
        ap.error("choose a workload (--burst, --poisson, --trace, --multi-turn) or a mode")
    try:
        parse_dist(args.prompt_len or "1"), parse_dist(args.output_len)
        parse_mix(PAPER_MIX if args.read_rate == "auto" else args.read_rate)
    except ValueError:
        ap.error("--prompt-len, --output-len: MEAN[:SPREAD]; --read-rate: RATE[:SHARE],... or auto")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    if args.conversations and ".jsonl" not in (args.trace or ""):
        ap.error("--conversations takes the conversations of a Mooncake trace (--trace *.jsonl)")
    if not set(args.policies.split(",")) <= set(POLICIES):
        ap.error(f"--policies: choose from {', '.join(POLICIES)}")
    if args.replicas is not None and (
        not args.simulate or args.multi_turn or args.replicas < 1 or args.scrape_interval <= 0
    ):
        ap.error("--replicas N (>= 1) needs --simulate and no --multi-turn; --scrape-interval > 0")
    if not set(args.router.split(",")) <= set(ROUTERS):
        ap.error(f"--router: choose from {', '.join(ROUTERS)}")
    if args.fidelity and (
        args.read_rate == "auto" or args.simulate or args.http or args.replicas or not any(workload)
    ):
        ap.error(
            "--fidelity needs a workload, --read-rate (both sides read the same) and the "
            "real engine (no --simulate, --http or --replicas)"
        )
    if args.http and (args.read_rate == "auto" or args.multi_turn):
        ap.error(
            "--http needs --read-rate (auto measures an engine in this process) and no "
            "--multi-turn (a later turn needs the answer's tokens)"
        )
    return args


def run_workload(args: argparse.Namespace) -> tuple[list[Run], Workload, dict]:
    """The workload of args, through a server or under each policy in this process."""
    args.prompt_len = args.prompt_len or "64:16"
    w = build_workload(args)
    if args.http:
        w = w.clamped(args.context)
        runs, info = [drive_http(args.http, w)], {"engine": f"server at {args.http}"}
    else:
        runs, w, info = run_policies(args, w)
    info.update(rates=info.get("rates", args.read_rate), ttft_slo=ttft_slo(args))
    for run in runs:
        run.ttft_slo = info["ttft_slo"]
    return runs, w, info


def ttft_slo_ceiling(w: Workload, prefill_rate: float, slo: float) -> float:
    """The share of first tokens within the SLO were the engine to do nothing but the prompts, one
    after another in arrival order: past capacity, what the prompt rate allows any such policy."""
    within, free_at = 0, 0.0
    for arrival, prompt in sorted(zip(w.arrival, w.prompt_len)):
        free_at = max(free_at, arrival) + prompt / prefill_rate
        within += free_at - arrival <= slo
    return within / len(w)


def ttft_slo(args: argparse.Namespace) -> float:
    """--ttft-slo, else 2 s on a GPU (or its simulation) and CPU_SLO_SCALE times that on a CPU."""
    if args.simulate:  # a CPU preset, or the cost model fitted to this (CPU) engine
        on_cpu = cost_model(args.preset).name.startswith(("cpu", "calibrated"))
    else:
        on_cpu = not torch.cuda.is_available()
    return args.ttft_slo or TTFT_SLO * (CPU_SLO_SCALE if on_cpu else 1)


def serving_bench(args: argparse.Namespace) -> None:
    credit = MOONCAKE_CREDIT if ".jsonl" in (args.trace or "") else TRACE_CREDIT
    if args.trace:
        print(f"trace: {credit}")
    runs, w, info = run_workload(args)
    print(f"workload: {w.source}; seed {args.seed}")
    print(f"engine: {info['engine']}")
    if "threads" in info:
        print(f"compute: {info['threads']}")
    if "kv_blocks" in info:
        print(
            f"KV memory: {info['kv_blocks']} blocks of {BLOCK_SIZE} tokens hold "
            f"{info['probe_batch']} of the {len(w)} requests at full length"
        )
    print(f"readers: {info['rates']}; TTFT SLO {info['ttft_slo']} s")
    if "prefill_rate" in info and not w.follows:
        ceiling = ttft_slo_ceiling(w, info["prefill_rate"], info["ttft_slo"])
        print(
            f"TTFT <= SLO ceiling: {ceiling:.0%} (every prompt in arrival order at the measured "
            f"{info['prefill_rate']:.0f} prompt tokens/s, nothing else computed)"
        )
    if w.block_ids:  # the trace's ids as far as the (clamped) prompts reach
        ids = [b[: cdiv(p, w.block_tokens)] for b, p in zip(w.block_ids, w.prompt_len)]
        capacity = (info["kv_blocks"] + info["host_blocks"]) * BLOCK_SIZE // w.block_tokens
        print(
            f"plain LRU of the trace's hash ids at the same capacity ({capacity} blocks of "
            f"{w.block_tokens}): {lru_hit_rate(ids, capacity):.1%} prefix hits; unbounded: "
            f"{lru_hit_rate(ids, math.inf):.1%}"
        )
    print(table(runs))
    for run in runs:
        if run.machine:
            print(describe_machine(run.name, run.machine))
    config = {
        **vars(args),
        "tokenflow": dataclasses.asdict(args.tokenflow or TokenFlowConfig()),
        **info,
        "mean_rate": sum(w.rate) / len(w),
        "workload": w.source,
        "machine": f"{platform.platform()}, {info.get('threads', 'simulated')}",
        **({"trace_credit": credit} if args.trace else {}),
    }
    if args.json:
        policies = {r.name: {**r.summary, "machine": r.machine} for r in runs}
        Path(args.json).write_text(json.dumps({"config": config, "policies": policies}, indent=2))
    if args.plot:
        plot(runs, args.plot)


def matrix(args: argparse.Namespace) -> None:
    """Each row once, or --repeat K times with seeds 0..K-1 of the step-time jitter: then the row's
    worst run (the most misses, then the highest tokenflow TTFT p99) and how many of K pass."""
    jitter = args.jitter or (REPEAT_JITTER if args.repeat > 1 else 0.0)
    base = f"{MATRIX_BASE}{' --uncharged' * args.uncharged} --jitter {jitter}"
    print(f"trace: {TRACE_CREDIT}\n{base} plus each row's arguments\n{MATRIX_HEAD}")
    results = []
    for row in (row for row in MATRIX if args.matrix in row[0]):
        runs = [
            r for i in range(args.repeat) for r in run_matrix([row], f"{base} --jitter-seed {i}")
        ]
        worst = max(runs, key=lambda r: (len(r[3]), r[2]["ttft_p99"]))
        passes = sum(not r[3] for r in runs)
        print(matrix_row(*worst, f"{passes}/{len(runs)} pass" if len(runs) > 1 else ""), flush=True)
        results.append(
            {
                **dict(zip(("regime", "fcfs", "tokenflow", "misses"), worst)),
                "passes": passes,
                "runs": len(runs),
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.gpu_check or args.kernels or args.transfers:
        gpu_check(args)
    if args.gpu_check:
        return
    if args.calibrate:
        print(calibrate(LLM(args.ckpt, device=args.device, dtype=args.dtype)).describe())
    if args.fidelity:
        fidelity(args)
    elif args.burst or args.poisson or args.trace or args.multi_turn:
        serving_bench(args)
    if args.sched_cost:
        sched_cost()
    if args.matrix is not None:
        matrix(args)
    if args.regimes is not None:
        regimes(args)


if __name__ == "__main__":
    main()
