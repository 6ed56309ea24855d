"""`bench.py --gpu-check`: the tests marked `cuda`, the timings of timing.py and a short burst under
both policies, each step's status and summary in one table and a JSON file. A step that needs a GPU
skips without one, and one that fails does not stop the others. `--kernels` and `--transfers` run
one step each.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.report import table
from benchmarks.runs import free_device_memory, run_workload
from benchmarks.timing import bench_decode_speed, bench_kernels, bench_transfers

GPU_CHECK_BURST = 32  # requests in --gpu-check's burst: both policies in about a minute on a GPU
GPU_CHECK_JSON = "gpu-check.json"


def run_cuda_tests() -> dict:
    """The test suite's `cuda`-marked tests, compiled kernels on the real device."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "test_all.py"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,  # the repository
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
