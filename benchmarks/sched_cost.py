"""`bench.py --sched-cost`: the scheduler's own CPU time per decision, per full rebalance and per
after_step(), with hundreds to thousands of requests running on the simulator.
"""

import functools
import itertools
import statistics
import time

from benchmarks.sim import build_engine
from benchmarks.timing import seconds
from nanoflow import SamplingParams
from nanoflow.policies import POLICIES, TokenFlow, make_policy


def sched_cost(sizes: tuple[int, ...] = (256, 1024, 4096), steps: int = 200) -> None:
    """Median CPU time (this process's, robust to a shared machine's neighbours) of one schedule()
    call, of a full rebalance and of after_step() with N requests running and N/8 waiting
    (simulator). The baseline admits them all (tokenflow admits only what the modelled H200 can
    serve: ~38k tok/s at 4096), then the policy timed takes over. Readers read 20 tok/s."""
    print(
        f"{'policy':>10} {'running':>8} {'ms per decision':>16} {'ms per rebalance':>16} "
        f"{'ms after step':>14}"
    )
    for policy, n in itertools.product(POLICIES, sizes):
        params = SamplingParams(max_tokens=4096, ignore_eos=True, read_rate=20)
        engine = build_engine("h200-llama3-8b", "fcfs", num_kv_blocks=n * 300)
        s = engine.scheduler
        s.max_num_seqs, s.max_num_batched_tokens = n, n + 2048  # a token for each, and prompts
        for _ in range(n + n // 8):
            engine.add_request([1] * 64, params)
        while len(s.running) < n:  # prefill everyone that fits
            engine.step()
        s.policy = make_policy(policy)
        for _ in range(20):  # a few decodes, so that readers have buffers
            engine.step()
        deciding = []
        after = []
        for _ in range(steps):
            deciding.append(seconds(s.schedule, time.process_time))
            engine.clock.advance_to(engine.clock() + 0.01)
            for req in s.running:  # what the step would have done: one more token each
                req.num_computed_tokens = req.num_tokens
                req.append(0, engine.clock())
            after_step = functools.partial(s.after_step, 0.01, 0, len(s.running))
            after.append(seconds(after_step, time.process_time))
        rebalance = "-"
        if isinstance(s.policy, TokenFlow):  # a full rebalance (working set, sort, fill, victims)
            now = engine.clock()
            rebalance_once = functools.partial(full_rebalance, s, now)
            spent = [seconds(rebalance_once, time.process_time) for _ in range(10)]
            rebalance = f"{statistics.median(spent) * 1e3:.3f}"
        print(
            f"{policy:>10} {n:>8} {statistics.median(deciding) * 1e3:>16.3f} {rebalance:>16} "
            f"{statistics.median(after) * 1e3:>14.3f}"
        )


def full_rebalance(s, now: float) -> None:
    s.policy.last_rebalance = float("-inf")
    s.policy.preemptions(s, now)
