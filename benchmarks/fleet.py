"""A fleet of simulated replicas behind a router that sees only what it scrapes (docs/fleet.md).

Each replica is a simulated engine (sim.py) with its own scheduler, KV pools, device and clock; the
fleet keeps their clocks on one timeline: the replica furthest behind steps next, and an arrival or
a scrape happens once every busy replica has reached its time. Every `scrape_interval` s the router
reads each replica's /metrics numbers (`Engine.stats`); in between it knows only those and what it
has sent since, as the routers people run do.
"""

import math
import random
from collections import deque
from dataclasses import dataclass

from nanoflow.engine import Engine
from nanoflow.request import Request
from nanoflow.metrics import kv_usage


@dataclass
class View:
    """What the router knows of one replica: its last scrape, and what it has sent there since."""

    scrape: dict
    sent: int = 0  # requests


class Router:
    """Picks the replica whose view has the smallest key; ties at random (as the endpoint picker
    does), from a seeded generator so that runs repeat."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def key(self, view: View) -> tuple:
        raise NotImplementedError

    def pick(self, views: list[View]) -> int:
        keys = [self.key(v) for v in views]
        return self.rng.choice([i for i, k in enumerate(keys) if k == min(keys)])


class RoundRobin(Router):
    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.count = -1

    def pick(self, views: list[View]) -> int:
        self.count += 1
        return self.count % len(views)


class LeastQueue(Router):
    """The endpoint picker's default scorers: the shortest queue, then the least KV in use."""

    def key(self, view: View) -> tuple:
        return view.scrape["waiting"] + view.sent, kv_usage(view.scrape)


ROUTERS = {"round-robin": RoundRobin, "least-queue": LeastQueue}


def make_router(name: str, seed: int = 0) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; available: {', '.join(ROUTERS)}")
    return ROUTERS[name](seed)


def simulate(
    engines: list[Engine], w, router: Router, scrape_interval: float = 1.0
) -> tuple[list[Request], list[int], float]:
    """Run workload w (a workloads.Workload: arrivals from 0, prompt_ids(i), params(i)) on the
    fleet. Returns each request in w's order, the replica that served it, and the start time."""
    if scrape_interval <= 0:
        raise ValueError(f"scrape_interval must be > 0 s, got {scrape_interval}")
    start = max(e.clock() for e in engines)  # warm-ups may have left the clocks apart
    for e in engines:
        e.clock.advance_to(start)
    order = deque(sorted(range(len(w)), key=lambda i: w.arrival[i]))
    reqs, where = [None] * len(w), [0] * len(w)
    next_scrape, views = start, []
    while order or any(e.has_unfinished() for e in engines):
        busy = [e for e in engines if e.has_unfinished()]
        behind = min(busy, key=lambda e: e.clock(), default=None)
        now = behind.clock() if behind else math.inf
        arrival = start + w.arrival[order[0]] if order else math.inf
        if next_scrape <= min(now, arrival):
            views = [View(e.stats()) for e in engines]
            next_scrape += scrape_interval
        elif arrival <= now:  # every busy replica is at or past it: it sees the arrival in time
            i = order.popleft()
            k = where[i] = router.pick(views)
            engines[k].clock.advance_to(arrival)  # an idle replica waited until now
            reqs[i] = engines[k].add_request(w.prompt_ids(i), w.params(i), arrival_time=arrival)
            views[k].sent += 1
        else:
            behind.step()
    return reqs, where, start
