"""What a serving run prints: each policy's metrics side by side (`table`), a PNG of every reader's
buffer over time and the TTFT CDFs (`plot`), and `serving_bench`, the mode of `bench.py --burst`,
`--poisson`, `--trace` and `--multi-turn`.
"""

import argparse
import dataclasses
import json
import math
import platform
from pathlib import Path

from benchmarks.runs import Run, describe_machine, run_workload
from benchmarks.workloads import (
    BLOCK_SIZE,
    MOONCAKE_CREDIT,
    TRACE_CREDIT,
    Workload,
    levels,
    lru_hit_rate,
)
from nanoflow.kv import cdiv
from benchmarks.summary import TTFT_TARGET
from nanoflow.metrics import read_times
from nanoflow.policies import TokenFlowConfig

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


def ttft_slo_ceiling(w: Workload, prefill_rate: float, slo: float) -> float:
    """The share of first tokens within the SLO were the engine to do nothing but the prompts, one
    after another in arrival order: past capacity, what the prompt rate allows any such policy."""
    within = 0
    free_at = 0.0
    for arrival, prompt in sorted(zip(w.arrival, w.prompt_len)):
        free_at = max(free_at, arrival) + prompt / prefill_rate
        within += free_at - arrival <= slo
    return within / len(w)


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
