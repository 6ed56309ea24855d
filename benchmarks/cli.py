"""nanoflow's benchmark: the same workload under each scheduling policy, side by side.

`python bench.py --burst 64` builds one workload from a seed (arrivals, prompt and output lengths,
each request's reading rate), runs it on the engine once per policy and prints TTFT, stalls, QoE
and throughput of each (docs/scheduling.md). `--simulate` drives a simulated engine on a virtual
clock, `--http URL` a running server or a router in front of replicas (timed at the client, counters
summed over the router's /workers); `--multi-turn N` runs chats that resend the conversation (over
HTTP as text, an X-Session-ID each). `--gpu-check` times the GPU parts.
"""

# (this docstring is `bench.py --help`'s description)

import argparse
import importlib.util

from benchmarks.fleet import ROUTERS
from benchmarks.runs import CPU_SLO_SCALE, DEFAULT_KV_FRAC, ENGINE_FLAGS, GOOD_SHARE
from benchmarks.sim import PRESETS
from benchmarks.workloads import PAPER_MIX, TRACE_BLOCK, TRACE_CREDIT, parse_dist, parse_mix
from nanoflow.engine import EngineConfig
from benchmarks.summary import TTFT_SLO
from nanoflow.policies import POLICIES

REPEAT_JITTER = 0.03  # --matrix --repeat: step times vary by up to 3% (uniformly), as on a GPU


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
    add("--http", metavar="URL", help="send the workload to a running server or router")
    add(
        "--serve",
        action="store_true",
        help="each policy behind nanoflow's HTTP server in this process, timed at the client",
    )
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
    check_workload(ap, args)
    check_engines(ap, args)
    return args


def check_workload(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A workload or a mode, and values that parse: a clear error before anything loads."""
    workload = (args.burst, args.poisson, args.trace, args.multi_turn)
    modes = (args.gpu_check, args.kernels, args.transfers, args.sched_cost, args.calibrate)
    if not (any(workload) or args.matrix is not None or args.regimes is not None or any(modes)):
        ap.error("choose a workload (--burst, --poisson, --trace, --multi-turn) or a mode")
    try:
        parse_dist(args.prompt_len or "1")
        parse_dist(args.output_len)
        parse_mix(PAPER_MIX if args.read_rate == "auto" else args.read_rate)
    except ValueError:
        ap.error("--prompt-len, --output-len: MEAN[:SPREAD]; --read-rate: RATE[:SHARE],... or auto")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    if args.conversations and ".jsonl" not in (args.trace or ""):
        ap.error("--conversations takes the conversations of a Mooncake trace (--trace *.jsonl)")


def check_engines(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Policies, routers, and the engines the options can run on."""
    workload = (args.burst, args.poisson, args.trace, args.multi_turn)
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
    if args.serve and (args.simulate or args.http or args.replicas):
        ap.error("--serve needs the real engine (no --simulate, --http or --replicas)")
    if args.http and args.read_rate == "auto":
        ap.error("--http needs --read-rate (auto measures an engine in this process)")
