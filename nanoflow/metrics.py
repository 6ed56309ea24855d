"""The reader model and the metrics, one implementation for the scheduler, the bench and the server.

Everything below is a function of a request's arrival, its tokens' generation times and its
reader's rate r (docs/scheduling.md defines them all; the bench sums them up in
benchmarks/summary.py). At the end: /metrics. It imports no nanoflow module.
"""

import bisect
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass


# engine.stats() levels (the last four: the buffer signal, docs/scheduling.md); the rest are counts
ENGINE_GAUGES = {
    "running",
    "waiting",
    "preempted",
    "reader_demand_tokens_per_second",
    "capacity_tokens_per_second",
    "readers_dry_soon",
    "past_capacity",
}
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.3, 2.5, 5.0, 10.0, 30.0)  # s; 1.3 s: users give up
TBT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)  # s; 8 tok/s readers need < 0.125


def reads(token_times: list[float], rate: float) -> Iterator[tuple[float, float]]:
    """The reader model: each token's read time, and how long past its due time it was read."""
    due = float("-inf")
    for made in token_times:
        read = max(made, due)
        yield read, (max(0.0, read - due) if due > float("-inf") else 0.0)
        due = read + 1.0 / rate


def read_times(token_times: list[float], rate: float) -> list[float]:
    return [read for read, _ in reads(token_times, rate)]


def rebuffer_time(token_times: list[float], rate: float) -> float:
    """Total time the reader waited for a token after the first one."""
    return sum(stall for _, stall in reads(token_times, rate))


@dataclass
class RequestRecord:
    arrival: float
    token_times: list[float]
    rate: float

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival


# ---------------------------------------------------------------- /metrics, as Prometheus text


class Histogram:
    """A Prometheus histogram: counts per bucket upper bound, a sum and a count."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name = name
        self.help = help
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]


class Metrics:
    """The server's counters and histograms; rendered with a snapshot of the engine's stats."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.tokens = {"prompt": 0, "generation": 0}
        self.ttft = Histogram(
            "nanoflow_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.tbt = Histogram(
            "nanoflow_time_between_tokens_seconds", "Gap between consecutive tokens.", TBT_BUCKETS
        )
        self.scraped = False  # once true, every engine snapshot carries the buffer signal
        self.rebuffer = Histogram(
            "nanoflow_rebuffer_seconds",
            "Time a request's reader stalled (docs/scheduling.md).",
            TTFT_BUCKETS,
        )

    def rejected(self, code: str) -> None:
        with self.lock:
            self.outcomes[code] += 1

    def finished(
        self, reason: str, prompt_tokens: int, record: RequestRecord, rebuffer: float
    ) -> None:
        with self.lock:
            self.outcomes[reason] += 1
            self.tokens["prompt"] += prompt_tokens
            self.tokens["generation"] += len(record.token_times)
            if record.token_times:
                self.ttft.observe(record.ttft)
                self.rebuffer.observe(rebuffer)
            for a, b in zip(record.token_times, record.token_times[1:]):
                self.tbt.observe(b - a)

    def render(self, stats: dict, num_queued: int, model_name: str = "nanoflow") -> str:
        with self.lock:
            out = [
                "# HELP nanoflow_requests_total Requests by outcome: finish reason, or the "
                "error code.",
                "# TYPE nanoflow_requests_total counter",
            ]
            out += [
                f'nanoflow_requests_total{{outcome="{k}"}} {n}'
                for k, n in sorted(self.outcomes.items())
            ]
            out += ["# TYPE nanoflow_tokens_total counter"]
            out += [f'nanoflow_tokens_total{{kind="{k}"}} {n}' for k, n in self.tokens.items()]
            out += [
                "# HELP nanoflow_queued_requests Requests without a first token (compared "
                "with --max-waiting).",
                "# TYPE nanoflow_queued_requests gauge",
                f"nanoflow_queued_requests {num_queued}",
            ]
            out += self.ttft.lines() + self.tbt.lines() + self.rebuffer.lines()
        return "\n".join(out + engine_lines(stats) + vllm_lines(stats, model_name)) + "\n"


def engine_lines(stats: dict) -> list[str]:
    """Numeric engine.stats() keys: levels as gauges, others counters; `X_blocks_used` too."""
    out = []
    for key, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        gauge = key in ENGINE_GAUGES or "_blocks_" in key
        name = f"nanoflow_{key}" if gauge else f"nanoflow_{key}_total"
        out += [f"# TYPE {name} {'gauge' if gauge else 'counter'}", f"{name} {value}"]
        total = stats.get(key.removesuffix("_free") + "_total")
        if key.endswith("_blocks_free") and total is not None:
            used = f"nanoflow_{key.removesuffix('_free')}_used"
            out += [f"# TYPE {used} gauge", f"{used} {total - value}"]
    return out


def vllm_lines(stats: dict, model_name: str) -> list[str]:
    """The gauges routers read from vLLM (the Gateway API endpoint picker, production-stack), by
    vLLM's names: a router configured for vLLM routes to nanoflow unchanged (docs/fleet.md)."""
    if "running" not in stats:
        return []
    values = {
        "num_requests_waiting": stats["waiting"],
        "num_requests_running": stats["running"],
        "kv_cache_usage_perc": kv_usage(stats),
    }
    label = model_name.replace("\\", "\\\\").replace('"', '\\"')
    return [
        line
        for name, value in values.items()
        for line in (f"# TYPE vllm:{name} gauge", f'vllm:{name}{{model_name="{label}"}} {value}')
    ]


def kv_usage(stats: dict) -> float:
    """The share of device KV blocks in use, in [0, 1] (cached unreferenced blocks count as
    free, as in vLLM)."""
    return 1 - stats["device_blocks_free"] / max(1, stats["device_blocks_total"])
