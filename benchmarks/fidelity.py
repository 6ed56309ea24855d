"""The simulator beside the real engine. `--fidelity` runs one workload on this engine and replays
it on the simulator with a cost model fitted in the same run: each metric's error, the first
decision where the two schedules part, and the part of the steps' time the cost model leaves out.
`--regimes` does the same for the real engine's regime set: both policies, repeated, a verdict per
row.
"""

import argparse
import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cli import parse_args
from benchmarks.report import aligned
from benchmarks.runs import (
    NOT_QUIET_SHARE,
    Run,
    describe_machine,
    free_device_memory,
    run_policies,
    run_workload,
    ttft_slo,
)
from benchmarks.sim import (
    CostModel,
    Step,
    busy,
    calibrate,
    calibration_steps,
    engine_base,
    fit_steps,
)
from benchmarks.workloads import Workload, build_workload, levels
from nanoflow import LLM
from nanoflow.engine import EngineConfig
from nanoflow.metrics import RequestRecord

FIDELITY_METRICS = [
    ("TTFT p50 (s)", "ttft_p50"),
    ("TTFT p99 (s)", "ttft_p99"),
    ("rebuffer mean (s)", "rebuffer_mean"),
    ("QoE mean", "qoe_mean"),
    ("throughput (tok/s)", "throughput"),
    ("preemptions", "preemptions"),
]
REBUFFER_SLACK_S = 0.5  # rebuffer mean: within 15% or this many seconds (issue 40)
DRAIN_S = 1e-3  # requests the server's loop adds this close together came in one drain


def fidelity_table(real: list[Run], sim: list[Run]) -> str:
    """Each metric on the engine and on the simulator, and the simulator's relative error."""
    lines = [["", *(f"{r.name} {side}" for r in real for side in ("real", "sim", "error"))]]
    for label, key in FIDELITY_METRICS:
        row = [label]
        for a, b in zip(real, sim):
            x, y = a.summary[key], b.summary[key]
            row += [f"{x:.3g}", f"{y:.3g}", f"{(y - x) / x:+.0%}" if x else "-"]
        lines.append(row)
    return aligned(lines)


def step_residual(run: Run, cost: CostModel) -> str:
    """How long the run's steps took, decision to decision, against what the cost model says of
    the same batches: the part of an engine's time that the simulator does not model."""
    steps = timed_steps(run)
    spent = sum(t for _, t in steps)
    predicted = sum(cost.step_time(terms) for terms, _ in steps)
    return (
        f"{run.name}: {len(run.decisions)} steps took {spent:.1f} s, the cost model says "
        f"{predicted:.1f} s for the same batches ({spent / max(predicted, 1e-9) - 1:+.0%})"
    )


def by_index(run: Run) -> dict:
    return {id(r): i for i, r in enumerate(run.requests)}


def schedule_of(run: Run) -> list[dict[int, int]]:
    """Each decision of the run: which request (by its place in the workload) ran how many
    tokens. Two runs with the same schedule differ only in how long their steps took."""
    index = by_index(run)
    return [{index[id(r)]: n for r, n in d.ran.items()} for d in run.decisions]


def first_parting(real: Run, sim: Run, shown: int = 8) -> str:
    """The first decision at which the two schedules differ, with the policy's inputs beside."""
    ri, si = by_index(real), by_index(sim)
    schedules = zip(schedule_of(real), schedule_of(sim))
    for k, (a, b, (ran_a, ran_b)) in enumerate(zip(real.decisions, sim.decisions, schedules)):
        if ran_a == ran_b:
            continue
        seen_a = {ri[id(r)]: v for r, v in a.seen.items()}
        seen_b = {si[id(r)]: v for r, v in b.seen.items()}
        t0, t1 = real.start, sim.start
        lines = [
            f"{real.name}: the schedules part at decision {k} (real t={a.at - t0:.2f} s, "
            f"sim t={b.at - t1:.2f} s)",
            f"  step estimate real {a.step_s * 1e3:.0f} ms, sim {b.step_s * 1e3:.0f} ms; "
            f"prefill rate real {a.prefill_rate:.0f}, sim {b.prefill_rate:.0f} tok/s; "
            f"free blocks real {a.free_blocks}, sim {b.free_blocks}",
            "  request: real (state, output tokens, s to dry, tokens run) | sim (same)",
        ]
        differ = sorted(i for i in seen_a.keys() | seen_b.keys() if ran_a.get(i) != ran_b.get(i))
        for i in differ[:shown]:
            lines.append(
                f"  #{i}: {seen_side(seen_a.get(i), ran_a.get(i))} | "
                f"{seen_side(seen_b.get(i), ran_b.get(i))}"
            )
        if len(differ) > shown:
            lines.append(f"  ... and {len(differ) - shown} more")
        return "\n".join(lines)
    common = min(len(real.decisions), len(sim.decisions))
    return (
        f"{real.name}: the same {common} decisions (the engine made {len(real.decisions)}, "
        f"the simulator {len(sim.decisions)})"
    )


def seen_side(seen: tuple | None, ran: int | None) -> str:
    if seen is None:
        return "not there"
    status, tokens, dry = seen
    return f"{status}, {tokens}, {dry:+.2f}, {ran or 0}"


def fit_cost_model(args: argparse.Namespace) -> CostModel:
    """The simulator's cost model, fitted to this engine now (bench.py --calibrate's fit)."""
    fit = calibrate(calibration_llm(args))
    free_device_memory()
    return fit


def calibration_llm(args: argparse.Namespace) -> LLM:
    options = {"device": args.device, "dtype": args.dtype, "cpu_threads": args.cpu_threads}
    return LLM(args.ckpt, **options)


def replay(
    args: argparse.Namespace, w: Workload, info: dict, fit: CostModel, real: list[Run]
) -> list[Run]:
    """The real runs on the simulator with `fit`: their workload, KV pools and policies, each
    policy starting from the rates its real warm-up measured (one admission more or fewer at the
    first step moves a burst's TTFTs by seconds)."""
    link = info.get("link_bytes_per_s", fit.link_bytes_per_s)  # the copies of the real runs
    cost = dataclasses.replace(fit, num_kv_blocks=info["kv_blocks"], link_bytes_per_s=link)
    host_kv_gb = EngineConfig.host_kv_gb if args.host_kv_gb is None else args.host_kv_gb
    sim_args = argparse.Namespace(
        **{
            **vars(args),
            "simulate": True,
            "serve": False,
            "preset": cost,
            "num_kv_blocks": info["kv_blocks"],
            "host_kv_gb": host_kv_gb,
        }
    )
    sim = []
    for run in real:
        sim_args.policies = run.name
        sim.append(served_replay(sim_args, w, run) if args.serve else replay_run(sim_args, w, run))
        sim[-1].ttft_slo = ttft_slo(args)
    return sim


def replay_run(sim_args: argparse.Namespace, w: Workload, real: Run) -> Run:
    (sim,), _, _ = run_policies(sim_args, w, {real.name: real.start_rates})
    return sim


def served_replay(sim_args: argparse.Namespace, w: Workload, real: Run) -> Run:
    """A run through the server on the simulator, which models no HTTP: each request reaches the
    engine when it reached the real one (its way in and the server's loop, measured), and its
    tokens reach its client as late as the real one's first token did (its way out). TTFTs count
    from the client's send, as the real run's do."""
    reached = [q.arrival_time - r.arrival for q, r in zip(real.requests, real.records)]
    added = drained_together([a + d for a, d in zip(w.arrival, reached)])
    sim = replay_run(sim_args, dataclasses.replace(w, arrival=added), real)
    way_in = [t - a for t, a in zip(added, w.arrival)]
    way_out = [r.token_times[0] - q.token_times[0] for r, q in zip(real.records, real.requests)]
    records = [
        RequestRecord(r.arrival - into, [t + out for t in r.token_times], r.rate)
        for r, into, out in zip(sim.records, way_in, way_out)
    ]
    return dataclasses.replace(sim, records=records, start=sim.start - way_in[0])


def drained_together(times: list[float]) -> list[float]:
    """Each time moved to the last of those within DRAIN_S of one another: the server's loop adds
    a drain of its inbox microseconds apart, all before the same step, and so must the replay."""
    last = {}
    end = later = math.inf
    for t in sorted(times, reverse=True):
        if later - t > DRAIN_S:
            end = t
        last[t] = end
        later = t
    return [last[t] for t in times]


def fidelity(args: argparse.Namespace) -> None:
    """Fit the cost model on this engine, run the workload on the engine, replay it on the
    simulator with that fit, per policy: the simulator's error and where the schedules part."""
    args.prompt_len = args.prompt_len or "64:16"
    fit = fit_cost_model(args)
    real, w, info = run_policies(args, build_workload(args))
    for run in real:
        run.ttft_slo = ttft_slo(args)
    sim = replay(args, w, info, fit, real)
    print(f"workload: {w.source}; seed {args.seed}; readers {args.read_rate}")
    print(f"engine: {info['engine']}; compute: {info['threads']}")
    print(f"fitted in this run: {fit.describe()}")
    if "link_bytes_per_s" in info:
        print(f"the engine's copies measured {info['link_bytes_per_s'] / 1e9:.2g} GB/s")
    print(fidelity_table(real, sim))
    for a, b in zip(real, sim):
        print(first_parting(a, b))
    for run in real:
        print(step_residual(run, fit))
    for run in real:
        print(describe_machine(run.name, run.machine))
    if args.json:
        rows = {
            r.name: {"real": r.summary, "sim": s.summary, "machine": r.machine}
            for r, s in zip(real, sim)
        }
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": {**vars(args), "tokenflow": None},
                    "fit": fit.describe(),
                    "policies": rows,
                },
                indent=2,
                default=str,
            )
        )


# ---------------------------------------------------------------- the real engine's regimes


# Each row on the demo model and the CPU; a fit in the same run replays each row on the simulator.
# Bursts under, just past and far past what a 2-core engine makes at the batch its memory holds
# (~70, ~200 and ~290 tok/s at 4, 16 and 32 requests on 2026-12-04; the table prints each run's
# own share: its speed drifts by the hour). A row's runs take ~10-40 s per policy on 2 cores.
REGIMES_BASE = "--read-rate 8 --seed 0 --prompt-len 64:8 --output-len 96:16"
REGIMES = [
    ("burst 4", "--burst 4 --kv-frac 1"),
    ("burst 16, readers at 16 tok/s", "--burst 16 --kv-frac 1 --read-rate 16"),
    ("burst 32, readers at 24 tok/s", "--burst 32 --kv-frac 1 --read-rate 24"),
    ("burst 16, memory for a third", "--burst 16 --kv-frac 0.33"),
    ("burst 32, memory for 9 (issue 40)", "--burst 32 --prompt-len 45:2 --output-len 128:0"),
    ("poisson 0.3/s", "--poisson 0.3 --duration 20"),
    ("poisson 1.4/s", "--poisson 1.4 --duration 15"),
    (
        "multi-turn chat",
        "--multi-turn 6 --turns 3 --think-time 2 --prompt-len 256:32 "
        "--output-len 32:8 --read-rate 20",
    ),
    ("long prompts", "--burst 6 --prompt-len 1024:64 --output-len 32:8"),
    (
        "burst 32 through the server (issue 40, item 3)",
        "--serve --burst 32 --prompt-len 45:2 --output-len 128:0 --kv-frac 1",
    ),
]
REGIME_METRICS = [
    ("TTFT p99", "ttft_p99", 1),
    ("rebuffer mean", "rebuffer_mean", 1),
    ("QoE mean", "qoe_mean", -1),
    ("throughput", "throughput", -1),
]
SERVER_REBUFFER = ("the server's rebuffer mean", "server_rebuffer_mean", 1)  # --serve rows
SIM_ERRORS = [
    ("TTFT p50", "ttft_p50"),
    ("TTFT p99", "ttft_p99"),
    ("throughput", "throughput"),
    ("rebuffer", "rebuffer_mean"),
]
FITTED_TO = {"own": "each row's own steps", "others": "the other rows' steps"}
SIM_TOLERANCE = 0.15  # issue 40: the simulator within 15% of the engine (rebuffer: or 0.5 s)


def through_server(summaries: list[dict]) -> bool:
    """Did these runs go through the server (--serve)? Their summaries carry its rebuffer."""
    return SERVER_REBUFFER[1] in summaries[0]


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3g} ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else f"{mean:.3g}"


def regime_verdict(name: str, fcfs: list[dict], tokenflow: list[dict]) -> list[str]:
    """What tokenflow loses against fcfs beyond the spread of fcfs's own repeats; TTFT p99 must
    be better in a burst row."""
    misses = []
    for label, key, sign in REGIME_METRICS + [SERVER_REBUFFER] * through_server(fcfs):
        ours, theirs = [s[key] for s in tokenflow], [s[key] for s in fcfs]
        noise = max(theirs) - min(theirs)
        if sign * (statistics.mean(ours) - statistics.mean(theirs)) > noise + 1e-9:
            misses.append(label)
    burst = name.startswith("burst")
    if burst and statistics.mean(s["ttft_p99"] for s in tokenflow) >= statistics.mean(
        s["ttft_p99"] for s in fcfs
    ):
        misses.append("TTFT p99 not better")
    return misses


def sim_errors(real: list[dict], sim: dict) -> tuple[str, int]:
    """The simulator's error against the mean of the engine's repeats, and how many are within
    tolerance (rebuffer: 15%, or 0.5 s, or the engine's own spread). Through the server, the
    engine's rebuffer is the server's: the client times a chunk, not each token in it."""
    parts = []
    within = 0
    served = through_server(real)
    for label, key in SIM_ERRORS:
        real_key = SERVER_REBUFFER[1] if served and key == "rebuffer_mean" else key
        values = [s[real_key] for s in real]
        mean = statistics.mean(values)
        error = (sim[key] - mean) / mean if mean else 0.0
        slack = max(REBUFFER_SLACK_S, max(values) - min(values)) if key == "rebuffer_mean" else 0
        within += abs(error) <= SIM_TOLERANCE or abs(sim[key] - mean) <= slack
        parts.append(f"{label} {error:+.0%}")
    return ", ".join(parts), within


@dataclass
class RegimeRow:
    """One row's runs on the real engine, kept until every row has run: each row's fit is made of
    the other rows' steps."""

    name: str
    at: str  # when its first run began (the machine's speed drifts over minutes)
    real: dict  # policy -> each repeat's summary and machine report
    same_decisions: list[bool]  # each repeat: did both policies run the same schedule?
    asked: list[float]  # each repeat: the readers' peak demand over the engine's tokens/s
    steps: list[Step]
    args: argparse.Namespace  # the last repeat's, for the replay
    workload: Workload
    info: dict
    runs: list[Run]  # the last repeat's: the replay starts each policy where its run did


def regimes(args: argparse.Namespace) -> None:
    """The real engine's regime set: each row under both policies, --repeat K times (the policy
    order alternating), and the simulator beside it. Each row's cost model is fitted in the same
    run, to the engine's calibration steps and the steps of every other row (not its own): a
    prediction, from the batches the rows run."""
    llm = calibration_llm(args)
    calibration, base = calibration_steps(llm), engine_base(llm.engine)
    del llm
    free_device_memory()
    rows = [run_regime(args, name, extra) for name, extra in REGIMES if args.regimes in name]
    print(
        "| regime | readers ask | TTFT p99 s | rebuffer mean s | QoE mean | throughput tok/s | "
        "verdict | simulator's error, fitted to the row's steps (fcfs; tokenflow) | ... to the "
        "other rows' |\n" + "|---" * 9 + "|"
    )
    results = []
    for row in rows:
        others = [step for other in rows if other is not row for step in other.steps]
        fits = {
            "own": fit_steps(calibration + row.steps, base, "the calibration and the row's"),
            "others": fit_steps(calibration + others, base, "the calibration and the other rows"),
        }
        results.append(print_regime(row, {k: replay_row(row, fit) for k, fit in fits.items()}))
        for k, fit in fits.items():
            results[-1][f"fit_{k}"] = fit.describe()
            results[-1][f"step_error_{k}"] = step_error(row.steps, fit)
    for result in results:
        print(
            f"{result['regime']} (from {result['at']}): its steps took "
            f"{result['step_error_others']:+.0%} of what the other rows' fit says"
        )
    for fit in FITTED_TO:
        print(sim_fit_line(results, fit))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results}, indent=2))


def sim_fit_line(results: list[dict], fit: str) -> str:
    """The rows where the simulator came within tolerance on every metric, under both policies."""
    rows = [r["regime"] for r in results if min(r["sim_within"][fit]) == len(SIM_ERRORS)]
    return (
        f"the simulator fitted to {FITTED_TO[fit]}: "
        f"within tolerance on all {len(SIM_ERRORS)} metrics under both policies in "
        f"{len(rows)} of {len(results)} rows ({'; '.join(rows) or 'none'})"
    )


def run_regime(args: argparse.Namespace, name: str, extra: str) -> RegimeRow:
    """One row on the real engine: both policies, max(2, --repeat) times, orders alternating."""
    own = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in (
            ("ckpt", args.ckpt),
            ("device", args.device),
            ("cpu_threads", args.cpu_threads),
        )
        if v
    ]
    real = {"fcfs": [], "tokenflow": []}
    same_decisions = []
    asked = []
    steps = []
    at = time.strftime("%H:%M:%S")
    for k in range(max(2, args.repeat)):
        order = "fcfs,tokenflow" if k % 2 == 0 else "tokenflow,fcfs"
        row_args = parse_args(f"{REGIMES_BASE} {extra} --policies {order}".split() + own)
        row_args.fidelity = True  # the runs log their decisions: the steps the fits are made of
        runs, w, info = run_workload(row_args)
        for run in runs:
            policy_ms = 1e3 * statistics.mean(d.policy_s for d in run.decisions)
            real[run.name].append({**run.summary, **run.machine, "policy_ms": policy_ms})
            steps += timed_steps(run)
        same_decisions.append(schedule_of(runs[0]) == schedule_of(runs[1]))
        asked.append(peak_demand(w) / info["capacity"])
    return RegimeRow(name, at, real, same_decisions, asked, steps, row_args, w, info, runs)


def peak_demand(w: Workload) -> float:
    """The readers' tokens/s at their peak, each reading from its arrival at its rate; a chat's
    later turns left out (each comes after its conversation's previous turn was read)."""
    first = [i for i in range(len(w)) if not w.follows or w.follows[i] < 0]
    arrivals = [w.arrival[i] for i in first]
    ends = [w.arrival[i] + w.output_len[i] / w.rate[i] for i in first]
    peak = max(n for _, n in levels(arrivals, ends))
    return peak * statistics.mean(w.rate)


def timed_steps(run: Run) -> list[Step]:
    """Each decision's step and the time until the next decision (a wait for arrivals included:
    fit_steps leaves those out)."""
    return [(a.batch, b.at - a.at) for a, b in zip(run.decisions, run.decisions[1:])]


def replay_row(row: RegimeRow, fit: CostModel) -> dict:
    return {r.name: r.summary for r in replay(row.args, row.workload, row.info, fit, row.runs)}


def step_error(steps: list[Step], fit: CostModel) -> float:
    """How much longer the steps took than the fit says (waits for arrivals left out)."""
    kept = busy(steps, fit)
    return sum(t for _, t in kept) / sum(fit.step_time(terms) for terms, _ in kept) - 1


def print_regime(row: RegimeRow, sims: dict[str, dict]) -> dict:
    """The row's line of the table (real cells, verdict, the simulator's errors with each fit),
    and its record."""
    real = row.real
    errors = {
        k: [sim_errors(real[p], sim[p]) for p in ("fcfs", "tokenflow")] for k, sim in sims.items()
    }
    misses = regime_verdict(row.name, real["fcfs"], real["tokenflow"])
    cells = [f"{spread(row.asked)}x"]
    cells += [policies_cell(real, key) for _, key, _ in REGIME_METRICS]
    if through_server(real["fcfs"]):
        cells[2] += f"; the server's: {policies_cell(real, SERVER_REBUFFER[1])}"
    cells += [regime_verdict_cell(row, misses)]
    quiet = max(s["others_cpu_share"] for p in real.values() for s in p) <= NOT_QUIET_SHARE
    cells[-1] += "" if quiet else " (not quiet)"
    cells += [f"{e[0][0]}; {e[1][0]}" for e in errors.values()]
    print(f"| {row.name} | {' | '.join(cells)} |", flush=True)
    return {
        "regime": row.name,
        "at": row.at,
        "real": real,
        "sim": sims,
        "misses": misses,
        "same_decisions": row.same_decisions,
        "asked": row.asked,
        "sim_within": {k: [e[1] for e in errs] for k, errs in errors.items()},
        "steps": [[*terms, t] for terms, t in row.steps],
    }


def policies_cell(real: dict, key: str) -> str:
    """fcfs -> tokenflow: each one's mean (min-max) over the repeats."""
    return " -> ".join(spread([s[key] for s in real[p]]) for p in ("fcfs", "tokenflow"))


def regime_verdict_cell(row: RegimeRow, misses: list[str]) -> str:
    """pass or the misses; where both policies ran the same schedule in every repeat, says so:
    their metrics then differ by the machine's speed and the policy's own time, not a decision."""
    verdict = "pass" if not misses else "misses: " + ", ".join(misses)
    if not all(row.same_decisions):
        return verdict
    return (
        f"the same decisions in {len(row.same_decisions)} of {len(row.same_decisions)} repeats "
        f"(deciding took {policies_cell(row.real, 'policy_ms')} ms a step); by the clock: "
        f"{verdict}"
    )
