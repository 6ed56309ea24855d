"""The bench's numbers over a run's requests: TTFT, stalls, QoE and throughput.

Every number is a function of each request's arrival, token times and reader's rate, through the
metric definitions of nanoflow/metrics.py (docs/scheduling.md defines each).
"""

import torch

from nanoflow.metrics import RequestRecord, effective_weights, qoe, rebuffer_time

TTFT_SLO = 2.0  # s: the bench's TTFT SLO on a GPU (--ttft-slo); a request without a token misses it


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
