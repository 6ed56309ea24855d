"""Runs: a workload through an engine, in this process (real or simulated, one engine or a fleet of
simulated replicas) or over HTTP to a running server; each policy's pass is a `Run`.

`run_workload` is the door every mode goes through: it builds the workload and, per policy, makes a
fresh engine (`engine_factory`), warms it up with the probe, then `drive`s the identical workload
(`drive_fleet` or `find_replicas` with --replicas; `drive_http` with --http). `MachineWatch` notes
what the rest of the machine did meanwhile; `record_decisions` logs the scheduler's decisions for
--fidelity.
"""

import argparse
import copy
import functools
import gc
import heapq
import http.client
import itertools
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch

from benchmarks.fleet import make_router, simulate
from benchmarks.sim import PRESETS, CostModel, StepTerms, build_engine
from benchmarks.workloads import (
    BLOCK_SIZE,
    Workload,
    auto_rates,
    build_workload,
    decode_rates,
    probe_workload,
)
from nanoflow import LLM
from nanoflow.engine import EngineConfig, busy_cpu_seconds
from nanoflow.kv import cdiv
from benchmarks.summary import TTFT_SLO, summarize
from nanoflow.metrics import RequestRecord
from nanoflow.sched import StepRates
from nanoflow.serve import make_server

CPU_SLO_SCALE = 2.5  # the TTFT SLO on a CPU: its prompts take ~10x a GPU's, its outputs are short
GOOD_SHARE = 0.97  # --find-replicas: the share of requests that must reach QoE >= 0.95
DEFAULT_KV_FRAC = 0.3  # device KV pool: this share of what the whole burst needs at full length
HTTP_TIMEOUT_S = 600.0
# --http --multi-turn: the words of each new message (common ones: about a token each)
WORDS = ("the", "a", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on")
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
    start_rates: StepRates | None = None  # what the warm-up left the policy (replays start there)

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
        self.label = label
        self.total = total
        self.last = 0.0
        self.begin = time.monotonic()

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
    wall = time.monotonic()
    before = engine.stats()
    start = engine.clock()
    reqs = {}
    bar = Progress(label, len(w))
    virtual_clock = hasattr(engine.clock, "advance_to")
    follows = w.follows or [-1] * len(w)
    due = [(start + a, i) for i, (a, f) in enumerate(zip(w.arrival, follows)) if f < 0]
    heapq.heapify(due)  # a replay's arrivals (the engine's, through a server) come in any order
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
    return finished_run(label, reqs, start + w.arrival[0], counters, wall)


def finished_run(label: str, reqs: list, start: float, counters: dict, wall: float) -> Run:
    """The Run of requests that all finished; `wall`: time.monotonic() when the drive began."""
    return Run(label, [r.record() for r in reqs], start, counters, time.monotonic() - wall, reqs)


def drive_fleet(engine, w: Workload, label: str, router: str, args: argparse.Namespace) -> Run:
    """w on --replicas copies of the warmed-up engine behind the router (benchmarks/fleet.py)."""
    engines = [copy.deepcopy(engine) for _ in range(args.replicas)]
    before = engine.stats()
    wall = time.monotonic()
    reqs, _, start = simulate(engines, w, make_router(router, args.seed), args.scrape_interval)
    counters = {k: sum(e.stats()[k] - before[k] for e in engines) for k in COUNTERS}
    return finished_run(f"{router}/{label}", reqs, start + w.arrival[0], counters, wall)


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


def http_call(
    url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None
):
    """A request to the server at url (with or without /v1); the response, headers read."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=HTTP_TIMEOUT_S)
    path = parts.path.rstrip("/").removesuffix("/v1") + path
    headers = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body and json.dumps(body), headers)
    return conn.getresponse()


def http_stream(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[list, str]:
    """One streamed request (a completion or a chat): the client-side token times, the text."""
    times = []
    tokens = 0
    pieces = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        resp = http_call(url, "POST", path, body, headers)
        if resp.status != 200:
            error = resp.read().decode(errors="replace")
            print(f"{path}: HTTP {resp.status}: {error}", file=sys.stderr)
        for line in resp if resp.status == 200 else []:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                new = [c.get("text") or c.get("delta", {}).get("content") for c in chunk["choices"]]
                if any(new):
                    times.append(time.monotonic())
                    pieces += filter(None, new)
    except OSError as e:
        print(f"{path}: {e}", file=sys.stderr)
    # a chunk that carries several tokens (a character split across tokens) counts them at the end
    return times + times[-1:] * (tokens - len(times)), "".join(pieces)


def sampling(w: Workload, i: int) -> dict:
    return {
        "max_tokens": w.output_len[i],
        "temperature": 0,
        "ignore_eos": True,
        "read_rate": w.rate[i],
    }


def send_request(url: str, w: Workload, i: int, start: float, out: list, sent: list) -> None:
    """One request as a streamed completion of token ids, sent at its arrival time."""
    time.sleep(max(0.0, start + w.arrival[i] - time.monotonic()))
    sent[i] = start + w.arrival[i]
    out[i] = http_stream(url, "/v1/completions", {"prompt": w.prompt_ids(i), **sampling(w, i)})[0]


def message(w: Workload, i: int) -> str:
    """Turn i's new message as text: about as many words (a token each, roughly) as its tokens."""
    rng = random.Random(w.seed * 1_000_003 + i)
    f = w.follows[i]
    size = w.prompt_len[i] - (w.prompt_len[f] + w.output_len[f] if f >= 0 else 0)
    return f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(max(1, size)))


def send_conversation(url: str, w: Workload, c: int, start: float, out: list, sent: list) -> None:
    """Conversation c's turns as streamed chats, each resending the earlier messages and answers
    as text, a think time after the previous answer ends; one X-Session-ID per conversation (what
    a router's session-affine policies read)."""
    nexts = {f: i for i, f in enumerate(w.follows) if f >= 0}
    messages = []
    i = c
    at = start + w.arrival[c]
    while i is not None:
        time.sleep(max(0.0, at - time.monotonic()))
        sent[i] = at
        messages.append({"role": "user", "content": message(w, i)})
        body = {"messages": messages, **sampling(w, i)}
        headers = {"X-Session-ID": f"conversation-{c}"}
        out[i], answer = http_stream(url, "/v1/chat/completions", body, headers)
        messages.append({"role": "assistant", "content": answer})
        ended = out[i][-1] if out[i] else time.monotonic()
        i = nexts.get(i)
        at = ended + (w.arrival[i] if i is not None else 0)


def servers(url: str) -> list[str]:
    """The replicas behind a router (vllm-router's GET /workers lists them), else url itself."""
    resp = http_call(url, "GET", "/workers")
    answer = resp.read()
    if resp.status != 200 or not answer.startswith(b"{"):
        return [url]
    return [worker["url"] for worker in json.loads(answer).get("workers", [])] or [url]


def scrape_counters(urls: list[str]) -> dict[str, float]:
    """COUNTERS summed over the servers' /metrics."""
    total = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        text = http_call(url, "GET", "/metrics").read().decode()
        values = dict(x.rsplit(" ", 1) for x in text.splitlines() if x and not x.startswith("#"))
        for k in COUNTERS:
            total[k] += float(values.get(f"nanoflow_{k}_total", 0))
    return total


def drive_http(url: str, w: Workload) -> Run:
    """The workload through a running server, or a router in front of several: one thread per
    request (--multi-turn: per conversation), timed at the client. Counters: summed over every
    replica the router lists."""
    try:
        # loading its checkpoint: nanoflow answers '"loading"', llama.cpp's server 'Loading model'
        while b"loading" in http_call(url, "GET", "/health").read().lower():
            time.sleep(1)
        wall = time.monotonic()
        urls = servers(url)
        before = scrape_counters(urls)
    except OSError as e:
        raise SystemExit(f"no server at {url} ({e}); start one: python -m nanoflow.serve") from None
    start = time.monotonic() + 0.1
    times = [None] * len(w)
    sent = [start + a for a in w.arrival]
    if w.follows:  # the first turns start the conversations
        send, firsts = send_conversation, [i for i, f in enumerate(w.follows) if f < 0]
    else:
        send, firsts = send_request, range(len(w))
    threads = [
        threading.Thread(target=send, args=(url, w, i, start, times, sent), daemon=True)
        for i in firsts
    ]
    for t in threads:
        t.start()
    bar = Progress("http", len(w))
    while any(t.is_alive() for t in threads):
        bar.show(sum(x is not None for x in times), sum(len(x) for x in times if x))
        time.sleep(0.1)
    bar.show(len(w), sum(len(x or []) for x in times), final=True)
    records = [RequestRecord(a, x or [], r) for a, x, r in zip(sent, times, w.rate)]
    counters = {k: int(v - before[k]) for k, v in scrape_counters(urls).items()}
    name = f"http x{len(urls)}" if len(urls) > 1 else "http"
    return Run(name, records, start + w.arrival[0], counters, time.monotonic() - wall)


def drive_served(llm: LLM, w: Workload, label: str) -> Run:
    """The workload through nanoflow's HTTP server on llm, in this process: drive_http's client
    threads beside the server's, so the streams, the detokenizer and the HTTP side are in the
    run. Counters add the server's own rebuffer mean (its readers, at each request's read_rate)."""
    added = []
    add_request = llm.engine.add_request

    def logged_add_request(*args, **kwargs):
        added.append(add_request(*args, **kwargs))
        return added[-1]

    llm.engine.add_request = logged_add_request
    server = make_server(llm, port=0).start()
    try:
        run = drive_http(server.url, w)
    finally:
        server.shutdown()
    rebuffer = server.metrics.rebuffer
    run.counters["server_rebuffer_mean"] = rebuffer.sum / max(1, sum(rebuffer.counts))
    run.name = label
    # the engine's requests in the workload's order (told apart by their prompts)
    by_prompt = {tuple(r.prompt_token_ids): r for r in added}
    run.requests = [by_prompt[tuple(w.prompt_ids(i))] for i in range(len(w))]
    return run


def engine_factory(args: argparse.Namespace, w: Workload):
    """policy -> a fresh simulated engine or real LLM, and a description of it."""
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
    return (lambda policy: LLM(args.ckpt, policy=policy, **options)), f"real engine: {where}"


def cost_model(preset: str | CostModel) -> CostModel:
    """--preset's cost model, or the one --fidelity fitted to this engine."""
    return preset if isinstance(preset, CostModel) else PRESETS[preset]()


def run_policies(
    args: argparse.Namespace, w: Workload, start_rates: dict[str, StepRates] | None = None
) -> tuple[list[Run], Workload, dict]:
    """Each policy on a fresh engine: the same warm-up probe, then the identical workload.
    start_rates (a replay): each policy starts from these rates instead of its warm-up's."""
    make, where = engine_factory(args, w)
    runs = []
    info = {"engine": where}
    for policy in args.policies.split(","):
        made = make(policy=policy)
        engine = made if args.simulate else made.engine
        blocks = engine.stats()["device_blocks_total"]
        if not args.simulate:
            info["threads"] = engine.threads.describe() if engine.threads else "a GPU"
        context = min(engine.max_model_len, blocks * BLOCK_SIZE)  # the pool must hold a request
        w = w.clamped(context)
        probe = probe_workload(w, blocks, engine.scheduler.max_num_batched_tokens)
        probe = drive(engine, probe.clamped(context), "warm-up")
        warmed = copy.deepcopy(engine.scheduler.rates)
        if start_rates:
            engine.scheduler.rates = copy.deepcopy(start_rates[policy])
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
            runs.append(drive_served(made, w, policy) if args.serve else drive(engine, w, policy))
            runs[-1].machine = {} if args.simulate else watch.report()
            runs[-1].decisions = decisions
            runs[-1].start_rates = warmed
            swapper = engine.scheduler.swapper
            if swapper and swapper.counters["bytes_to_host"]:  # what its copies measured
                info["link_bytes_per_s"] = swapper.bandwidth
        del engine, made
        free_device_memory()
    return runs, w, info


def free_device_memory() -> None:
    """Free the last engine before the next sizes its pool (torch's cache counts as used memory)."""
    gc.unfreeze()  # LLM() froze it
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Decision:
    """One schedule() that ran something: who got how many tokens, and what the policy saw."""

    at: float  # the engine's clock
    ran: dict  # request -> new tokens this step
    seen: dict  # request -> (status, output tokens, seconds until its reader runs dry)
    step_s: float  # the policy's estimate of a decode step of the running batch
    prefill_rate: float  # ...and of prompt tokens/s
    free_blocks: int
    batch: StepTerms  # what it computes, in the cost model's terms
    policy_s: float  # wall seconds the scheduler took to decide (policy and bookkeeping)


def record_decisions(scheduler) -> list[Decision]:
    """Log scheduler's decisions from now on (the bench's own trace; the engine is unchanged)."""
    log = []
    decide = scheduler.schedule

    def schedule():
        now = scheduler.clock()
        seen = {
            r: (r.status.value, r.num_output_tokens, r.dry_at - now)
            for r in itertools.chain(scheduler.running, scheduler.waiting)
        }
        step_s = scheduler.step_time()
        free = scheduler.kv.num_free
        began = time.perf_counter()
        out = decide()
        spent = time.perf_counter() - began
        if out:
            batch = StepTerms.of(out)
            prefill_rate = scheduler.rates.prefill_rate
            log.append(Decision(now, dict(out), seen, step_s, prefill_rate, free, batch, spent))
        return out

    scheduler.schedule = schedule
    return log


def run_workload(args: argparse.Namespace) -> tuple[list[Run], Workload, dict]:
    """The workload of args, through a server or under each policy in this process."""
    args.prompt_len = args.prompt_len or "64:16"
    w = build_workload(args)
    if args.http:
        w = w.clamped(args.context)
        runs = [drive_http(args.http, w)]
        info = {"engine": f"server at {args.http}"}
    else:
        runs, w, info = run_policies(args, w)
    info.update(rates=info.get("rates", args.read_rate), ttft_slo=ttft_slo(args))
    for run in runs:
        run.ttft_slo = info["ttft_slo"]
    return runs, w, info


def ttft_slo(args: argparse.Namespace) -> float:
    """--ttft-slo, else 2 s on a GPU (or its simulation) and CPU_SLO_SCALE times that on a CPU."""
    if args.simulate:  # a CPU preset, or the cost model fitted to this (CPU) engine
        on_cpu = cost_model(args.preset).name.startswith(("cpu", "calibrated"))
    else:
        on_cpu = not torch.cuda.is_available()
    return args.ttft_slo or TTFT_SLO * (CPU_SLO_SCALE if on_cpu else 1)
