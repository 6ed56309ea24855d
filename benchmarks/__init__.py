"""The bench's rooms: what `python bench.py` runs, one module per concern, and the simulator.

Named `benchmarks`, not `bench`: a package `bench/` beside bench.py would take the name `bench`
from the script (`import bench` finds the package first), and bench.py stays the entry point. It
is not installed with nanoflow (pyproject's `packages`): like bench.py, it runs from the
repository's root, where `import benchmarks` finds it (pytest's too: test_all.py sits there).

    sim.py        the simulator: the real scheduler on a virtual clock, a hardware cost model
    fleet.py      simulated replicas behind the routers people run (--replicas)
    workloads.py  the workload from a seed or a trace; --read-rate auto
    runs.py       a workload under each policy: in this process, on a fleet, or over HTTP
    report.py     the side-by-side table, the plot, the serving bench (--burst, --poisson, ...)
    cli.py        the command line (parse_args); its docstring is --help's description
    fidelity.py   the simulator beside the real engine: --fidelity, --regimes
    matrix.py     the simulated regime matrix: --matrix, its bar and verdicts
    timing.py     the GPU parts timed (kernels, transfers, decode) and the timers
    gpu_check.py  --gpu-check (and --kernels, --transfers): each step, its status, the JSON
    sched_cost.py --sched-cost: the scheduler's CPU time per decision

Each imports only those above it in this order (sim, fleet; workloads; runs; report; cli;
fidelity, matrix; timing; gpu_check, sched_cost): no circles.
"""
