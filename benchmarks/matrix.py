"""The simulated regime matrix (`bench.py --simulate --matrix`): each row of MATRIX under both
policies on a simulated H200, with a verdict against the bar (BAR) and the row's own targets;
`--repeat K` runs each row K times with jittered step times and prints its worst run.
"""

import argparse
import json
from pathlib import Path

from benchmarks.cli import REPEAT_JITTER, parse_args
from benchmarks.runs import run_workload
from benchmarks.workloads import TRACE_CREDIT

MATRIX_BASE = (
    "--simulate --preset h200-llama3-8b --prompt-len 512 --output-len 2048 --read-rate 20 --seed 0"
)
TRACE = Path(__file__).parent.parent / "data" / "azure_code_burst_10min.csv"
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

    def ratio(key: str) -> str:
        return f"{t[key] / f[key]:.2f}x" if f[key] else "-"

    verdict = "pass" if not misses else "FAIL: " + "; ".join(misses)
    verdict = f"{runs}; worst run: {verdict}" if runs else verdict
    return (
        f"| {name} | {f['ttft_p99']:.2f} -> {t['ttft_p99']:.2f} | {f['rebuffer_mean']:.2f} -> "
        f"{t['rebuffer_mean']:.2f} | {ratio('effective_throughput')} | {ratio('throughput')} | "
        f"{f['qoe_good_share']:.0%} -> {t['qoe_good_share']:.0%} | "
        f"{f['ttft_slo_share']:.0%} -> {t['ttft_slo_share']:.0%} | {verdict} |"
    )


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
