"""The reader model and the metrics, one implementation for the scheduler, the bench and the server.

A request's reader starts at its first token and reads one token every 1/r seconds, but never a
token that does not exist yet (docs/scheduling.md): `t_read[j] = max(t_gen[j], t_read[j-1] + 1/r)`. Its buffer
is what was generated and not yet read. Everything below is a function of the arrival time, the
generation time of each token and r.
"""

from dataclasses import dataclass

import torch

TTFT_TARGET = 1.3  # s: the delay past which users disengage (TokenFlow's user study); Andes' QoE target


def read_times(token_times: list[float], rate: float) -> list[float]:
    """When the virtual reader reads each token."""
    out, t = [], float("-inf")
    for g in token_times:
        t = max(g, t + 1.0 / rate)
        out.append(t)
    return out


def rebuffer_time(token_times: list[float], rate: float) -> float:
    """Total time the reader waited for a token after the first one."""
    reads = read_times(token_times, rate)
    return sum(max(0.0, reads[j] - (reads[j - 1] + 1.0 / rate)) for j in range(1, len(reads)))


def effective_weights(token_times: list[float], rate: float, output_len: int) -> list[float]:
    """TokenFlow §7.1.3: a token generated while the buffer B is <= 10% of the output length weighs 1,
    falling linearly to 0 at 20%: a token made long before anyone can read it is worth less."""
    reads = read_times(token_times, rate)
    low, high = 0.1 * output_len, 0.2 * output_len
    weights, read = [], 0
    for j, t in enumerate(token_times):
        while read < j and reads[read] <= t:
            read += 1
        buffer = j - read
        weights.append(1.0 if buffer <= low else max(0.0, (high - buffer) / (high - low)))
    return weights


def qoe(arrival: float, token_times: list[float], rate: float, ttft_target: float = TTFT_TARGET) -> float:
    """Andes' QoE: 1 - (reading delay past the ideal schedule) / (time from arrival to each read).

    Token i's ideal read time is arrival + ttft_target + (i-1)/r; a token read earlier than ideal
    counts as on time.
    """
    reads = read_times(token_times, rate)
    late = sum(max(0.0, t - (arrival + ttft_target + i / rate)) for i, t in enumerate(reads))
    total = sum(t - arrival for t in reads)
    return 1.0 - late / total if total > 0 else 1.0


@dataclass
class RequestRecord:
    """What the metrics need of one finished request."""

    arrival: float
    token_times: list[float]
    rate: float

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival


def percentile(xs: list[float], p: float) -> float:
    return torch.tensor(xs, dtype=torch.float64).quantile(p / 100).item() if xs else float("nan")


def summarize(records: list[RequestRecord], makespan: float) -> dict[str, float]:
    """The bench's and /metrics' numbers over finished requests, in seconds and tokens/s."""
    done = [r for r in records if r.token_times]
    ttfts = [r.ttft for r in done]
    tbts = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    rebuffers = [rebuffer_time(r.token_times, r.rate) for r in done]
    qoes = [qoe(r.arrival, r.token_times, r.rate) for r in done]
    tokens = sum(len(r.token_times) for r in done)
    weighted = sum(sum(effective_weights(r.token_times, r.rate, len(r.token_times))) for r in done)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "ttft_mean": mean(ttfts), "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "tbt_p99": percentile(tbts, 99),
        "rebuffer_mean": mean(rebuffers), "rebuffer_p99": percentile(rebuffers, 99),
        "qoe_mean": mean(qoes), "qoe_good_share": mean([q >= 0.95 for q in qoes]),
        "effective_throughput": weighted / makespan, "throughput": tokens / makespan, "makespan": makespan,
        "requests": len(records), "completed": len(done),
    }
