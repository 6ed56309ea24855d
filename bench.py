"""nanoflow's benchmark, the entry point: `python bench.py --help` lists its modes and flags.

Each mode lives in the package benchmarks/ (its __init__ maps the rooms): the command line
(cli.py), workloads, runs on the engine and over HTTP, the report, --fidelity and --regimes,
the simulated --matrix, --gpu-check and its timings, --sched-cost, and the simulator (sim.py)
and its fleet (fleet.py) that they drive. `main` sends each mode to its room.
"""

from benchmarks.cli import parse_args
from benchmarks.fidelity import fidelity, regimes
from benchmarks.gpu_check import gpu_check
from benchmarks.matrix import matrix
from benchmarks.report import serving_bench
from benchmarks.sched_cost import sched_cost
from benchmarks.sim import calibrate
from nanoflow import LLM


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
