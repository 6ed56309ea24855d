"""A fleet on this machine: N nanoflow replicas behind vLLM's router, started and stopped together.

    pip install -e ".[fleet]"
    python tools/fleet.py --replicas 2 --policy round_robin      # the demo model
    python tools/fleet.py -- --ckpt ./llama3-8b --policy fcfs   # after --: to each replica

Each replica is `python -m nanoflow.serve --port P --cpu-threads 1 ...` (ports after the router's),
the router `vllm-router --worker-urls ...` on --port, started once every replica answers /health.
Clients use http://127.0.0.1:8000/v1 as they would one server. Ctrl-C or SIGTERM drains the
replicas (their streams finish, docs/fleet.md), stops the router and waits for every process; a
second Ctrl-C kills them at once. Logs: one file per process in --log-dir. The `Fleet` class is
what the tests start (test_all.py, "issue 44").
"""

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the replicas import nanoflow from here
POLICIES = (
    "random",
    "round_robin",
    "cache_aware",
    "kv_aware",
    "power_of_two",
    "consistent_hash",
    "sticky_least_loaded",
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def healthy(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=2) as resp:
            return resp.status == 200
    except OSError:  # refused, reset, 503 (HTTPError), timed out
        return False


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the fleet dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so that no replica or router outlives it. Elsewhere a no-op. Linux counts
    the thread that started the child: start a fleet from a thread that outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class Fleet:
    """N replicas and the router, each in its own process group (a terminal's Ctrl-C reaches the
    fleet alone, which stops them in order). Ports 0 pick free ones."""

    def __init__(
        self,
        replicas: int = 2,
        policy: str = "round_robin",
        port: int = 8000,
        replica_ports: list[int] | None = None,
        host: str = "127.0.0.1",
        serve_args: list[str] = (),
        router_args: list[str] = (),
        cpu_threads: int | None = 1,
        health_interval: int = 5,
        log_dir: str | None = None,
        command: list[str] | None = None,
    ):
        self.host, self.policy = host, policy
        self.port = port or free_port(host)
        if replica_ports is None:
            replica_ports = [self.port + 1 + i for i in range(replicas)] if port else [0] * replicas
        self.replica_ports = [p or free_port(host) for p in replica_ports]
        self.serve_args, self.router_args = list(serve_args), list(router_args)
        self.cpu_threads, self.health_interval = cpu_threads, health_interval
        # what starts a replica, before its flags (a test starts one with a slowed engine)
        self.command = command or [sys.executable, "-m", "nanoflow.serve"]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="nanoflow-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: list[subprocess.Popen | None] = [None] * len(self.replica_ports)
        self.router: subprocess.Popen | None = None
        self.spawned: list[int] = []  # every process started, each its own group's leader
        self.reaped: set[int] = set()  # groups killed and leaders waited for (stop is idempotent)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def replica_url(self, i: int) -> str:
        return f"http://{self.host}:{self.replica_ports[i]}"

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child keeps it)
        with log:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.spawned.append(proc.pid)
        return proc

    def start_replica(self, i: int) -> None:
        argv = [*self.command, "--host", self.host]
        argv += ["--port", str(self.replica_ports[i])]
        if self.cpu_threads:
            argv += ["--cpu-threads", str(self.cpu_threads)]
        self.replicas[i] = self.spawn(f"replica-{i}", argv + self.serve_args)

    def wait_healthy(self, procs: dict, timeout: float) -> None:
        """procs: URL -> its process; returns when each answers /health 200."""
        deadline, waiting = time.monotonic() + timeout, dict(procs)
        while waiting:
            for url, proc in list(waiting.items()):
                if proc.poll() is not None:
                    raise RuntimeError(f"{url} exited with {proc.returncode}; see {self.log_dir}")
                if healthy(url):
                    del waiting[url]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {', '.join(waiting)}")
            time.sleep(0.1)

    def start(self, timeout: float = 600) -> "Fleet":
        router = shutil.which("vllm-router")
        if router is None:
            raise RuntimeError('vllm-router is not installed: pip install -e ".[fleet]"')
        try:
            for i in range(len(self.replicas)):
                self.start_replica(i)
            self.wait_healthy(
                {self.replica_url(i): p for i, p in enumerate(self.replicas)}, timeout
            )
            argv = [router, "--host", self.host, "--port", str(self.port), "--policy", self.policy]
            argv += ["--worker-urls", *map(self.replica_url, range(len(self.replicas)))]
            # its own metrics port (the default, 29000, is one per machine), health checks often
            # enough that a replica back on its port rejoins within seconds
            argv += ["--prometheus-port", str(free_port(self.host))]
            argv += ["--health-check-interval-secs", str(self.health_interval)]
            self.router = self.spawn("router", argv + self.router_args)
            self.wait_healthy({self.url: self.router}, timeout=60)
        except BaseException:
            self.stop(grace=0)
            raise
        return self

    def signal(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal replica i's process group (SIGKILL: a crash; SIGTERM: see drain)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.replicas[i].pid, sig)

    def drain(self, i: int, timeout: float = 10) -> None:
        """SIGTERM to replica i; returns once it drains (/health no longer 200)."""
        self.signal(i, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.replicas[i].poll() is None and healthy(self.replica_url(i)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {i} still answers /health 200 after SIGTERM")
            time.sleep(0.1)

    def restart(self, i: int, timeout: float = 300) -> None:
        """Replica i again on its port, once the old one has exited."""
        old = self.replicas[i]
        old.wait()
        with contextlib.suppress(ProcessLookupError):  # anything the old one started
            os.killpg(old.pid, signal.SIGKILL)
        self.reaped.add(old.pid)
        self.start_replica(i)
        self.wait_healthy({self.replica_url(i): self.replicas[i]}, timeout)

    def stop(self, grace: float = 40) -> None:
        """SIGTERM to the replicas (they drain for their --shutdown-timeout, 30 s by default), then
        to the router; SIGKILL to every process group still there after `grace` s (0: at once)."""
        replicas = [p for p in self.replicas if p]
        deadline = time.monotonic() + grace
        if grace:
            for i in (i for i, p in enumerate(self.replicas) if p):
                with contextlib.suppress(TimeoutError):  # then it is killed below
                    self.drain(i, timeout=min(grace, 10))
            for p in replicas:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if self.router and grace:  # after the replicas: their draining streams pass through it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.router.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.router.wait(timeout=max(5.0, deadline - time.monotonic()))
        for p in replicas + [self.router] * bool(self.router):
            if p.pid not in self.reaped:
                with contextlib.suppress(ProcessLookupError):  # the group: what it started too
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                self.reaped.add(p.pid)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args = []
    if "--" in argv:
        argv, serve_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    p = argparse.ArgumentParser(
        prog="python tools/fleet.py",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to every replica (python -m nanoflow.serve --help).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policy", choices=POLICIES, default="round_robin", help="the router's")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's; replicas: the next ones")
    p.add_argument("--replica-ports", type=int, nargs="+", help="one each; None: after --port")
    p.add_argument("--cpu-threads", type=int, default=1, help="per replica; 0: nanoflow's default")
    p.add_argument("--health-interval", type=int, default=5, help="s between the router's checks")
    p.add_argument("--router-args", default="", help="more vllm-router flags, one string")
    p.add_argument("--log-dir", help="one log per process; None: a new temporary folder")
    p.add_argument(
        "--run",
        metavar="CMD",
        help="a shell command to run once the fleet is up ({url}: the router's, {replicas}: "
        "theirs), then stop: its exit status is the fleet's",
    )
    args = p.parse_args(argv)
    if args.replica_ports and len(args.replica_ports) != args.replicas:
        p.error("--replica-ports: one port per replica")
    return args, serve_args


def watch(fleet: Fleet) -> int:
    """Says when a replica exits (the router routes around it); returns when the router exits."""
    while fleet.router.poll() is None:
        for i, proc in enumerate(fleet.replicas):
            if proc.returncode is None and proc.poll() is not None:
                print(f"fleet: replica {i} exited with {proc.returncode}", flush=True)
        time.sleep(0.5)
    print(f"fleet: the router exited with {fleet.router.returncode}", flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    fleet = Fleet(
        args.replicas,
        args.policy,
        args.port,
        args.replica_ports,
        args.host,
        serve_args,
        args.router_args.split(),
        args.cpu_threads,
        args.health_interval,
        args.log_dir,
    )

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: stop in order
    print(f"fleet: starting {args.replicas} replicas; logs in {fleet.log_dir}", flush=True)
    try:
        fleet.start()
        urls = " ".join(map(fleet.replica_url, range(args.replicas)))
        print(f"fleet: {fleet.url}/v1 ({args.policy}) -> {urls}; Ctrl-C stops", flush=True)
        if args.run:
            command = args.run.replace("{url}", fleet.url).replace("{replicas}", urls)
            return subprocess.run(command, shell=True).returncode
        return watch(fleet)
    except KeyboardInterrupt:
        print("fleet: draining the replicas (Ctrl-C again: kill)", flush=True)
        return 0
    finally:
        try:
            fleet.stop()
        except KeyboardInterrupt:
            fleet.stop(grace=0)
        print("fleet: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
