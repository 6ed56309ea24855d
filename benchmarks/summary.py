"""The bench's numbers over a run's requests: TTFT, stalls, QoE and throughput.

Every number is a function of each request's arrival, token times and reader's rate,
through the reader model of nanoflow/metrics.py. The two that only the bench reports,
a token's weight in the effective throughput and Andes' QoE, are defined here
(docs/scheduling.md defines each).
"""

import torch

from nanoflow.metrics import RequestRecord, read_times, rebuffer_time

TTFT_TARGET = 1.3  # s: past it users disengage (TokenFlow's user study); Andes' QoE target
TTFT_SLO = 2.0  # s: the bench's TTFT SLO on a GPU (--ttft-slo); a request without a token misses it


def effective_weights(token_times: list[float], rate: float) -> list[float]:
    """Each token's weight in the effective throughput
    (TokenFlow §7.1.3, docs/scheduling.md)."""
    times = read_times(token_times, rate)
    low, high = 0.1 * len(token_times), 0.2 * len(token_times)
    weights = []
    read = 0
    for j, t in enumerate(token_times):
        while read < j and times[read] <= t:
            read += 1
        buffer = j - read
        weights.append(1.0 if buffer <= low else max(0.0, (high - buffer) / (high - low)))
    return weights


def qoe(
    arrival: float, token_times: list[float], rate: float, ttft_target: float = TTFT_TARGET
) -> float:
    """Andes' QoE (docs/scheduling.md): reading before a token's due time counts as
    on time."""
    times = read_times(token_times, rate)
    late = sum(max(0.0, t - (arrival + ttft_target + i / rate)) for i, t in enumerate(times))
    total = sum(t - arrival for t in times)
    return 1.0 - late / total if total > 0 else 1.0


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def percentile(xs: list[float], p: float) -> float:
    return torch.tensor(xs, dtype=torch.float64).quantile(p / 100).item() if xs else float("nan")


def summarize(
    records: list[RequestRecord], makespan: float, ttft_slo: float = TTFT_SLO
) -> dict[str, float]:
    """The bench's numbers over finished requests, in seconds and tokens/s."""
    done = [r for r in records if r.token_times]
    ttfts = [r.ttft for r in done]
    tbts = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    rebuffers = [rebuffer_time(r.token_times, r.rate) for r in done]
    qoes = [qoe(r.arrival, r.token_times, r.rate) for r in done]
    tokens = sum(len(r.token_times) for r in done)
    weighted = sum(sum(effective_weights(r.token_times, r.rate)) for r in done)
    return {
        "ttft_mean": mean(ttfts),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tbt_p99": percentile(tbts, 99),
        "rebuffer_mean": mean(rebuffers),
        "rebuffer_p99": percentile(rebuffers, 99),
        "qoe_mean": mean(qoes),
        "qoe_good_share": mean([q >= 0.95 for q in qoes]),
        "ttft_slo_share": sum(t <= ttft_slo for t in ttfts) / max(1, len(records)),
        "effective_throughput": weighted / makespan,
        "throughput": tokens / makespan,
        "makespan": makespan,
        "requests": len(records),
        "completed": len(done),
    }
