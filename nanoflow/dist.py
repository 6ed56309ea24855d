"""Tensor parallelism: one process per rank over torch.distributed (NCCL on GPUs, gloo on CPUs).

Rank 0 (the `LLM`'s process: scheduler, server, sampler) starts a worker per other rank (rank r on
cuda:r), or joins the ranks torchrun started, maybe on several machines. Rank 0's `ModelRunner` and
`Swapper` send each call (forward, CUDA graph replay, swap copy) through `Ranks.send`; every worker,
with its shard of the weights and KV pools of the same block ids for its own KV heads, makes the
same call on its own. A dead worker ends rank 0 within a second, naming it; a worker whose rank 0 is
gone exits; signals are rank 0's to act on. It may import attention, kv, model, runner and swap.
"""

import atexit
import dataclasses
import datetime
import os
import signal
import socket
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .attention import AttnMetadata
from .kv import KVPool
from .model import Shard, load_model
from .runner import ModelRunner
from .swap import Swapper

WATCH_INTERVAL_S = 0.5  # how often rank 0 checks its workers and a worker its parent
JOIN_TIMEOUT_S = 10.0  # a worker that does not stop within this is killed
# workers wait for the next step as long as the server idles; deaths are caught by the watchdogs
IDLE_TIMEOUT = datetime.timedelta(days=365)
workers: list = []  # the worker processes rank 0 started (none under torchrun)
# the gloo group for the step messages, whatever the backend of the collectives: a weak reference,
# so that destroy_process_group ends its threads (left to the interpreter's exit, they may abort it)
control = None
leading = False  # this process is rank 0 of a live process group


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", 0))


def launch(ckpt, device: torch.device, size: int) -> Shard:
    """Join `size` ranks as rank 0 (one tensor-parallel LLM per process: a new one replaces
    the last). Starts ranks 1..size-1, or, under torchrun, meets those it started; there a
    rank other than 0 serves rank 0's steps instead, then ends its process."""
    global leading
    shutdown()
    # no device index: a worker's "cuda" is its current device, cuda:(local) rank
    device = torch.device(device.type)
    if "WORLD_SIZE" in os.environ:
        init_method = "env://"
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ValueError(
                f"tensor_parallel_size {size}, but torchrun started "
                f"{os.environ['WORLD_SIZE']} processes"
            )
        if torchrun_rank():
            worker(torchrun_rank(), size, init_method, str(ckpt), device)
            sys.exit(0)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            args = (rank, size, init_method, str(ckpt), device, os.getpid())
            p = ctx.Process(target=_spawned, args=args, daemon=True, name=f"nanoflow-rank{rank}")
            p.start()
            workers.append(p)
        threading.Thread(target=_watch_workers, daemon=True).start()
    _init(0, size, init_method, device)
    leading = True
    return Shard(0, size)


class Ranks:
    """Rank 0's line to the other ranks: the KV pools' shapes, then every call (`worker`)."""

    def __init__(self, kv: KVPool, num_host_blocks: int):
        _broadcast((kv.kv_cache.dtype, kv.num_blocks, kv.block_size, num_host_blocks))

    def send(self, name: str, *args) -> None:
        _broadcast((name, args))


def shutdown() -> None:
    """Stop the workers and leave the process group (rank 0; also at exit)."""
    global leading
    if not leading:
        return
    leading = False
    procs = list(workers)
    # first, so that the watchdog does not take these exits for deaths
    workers.clear()
    _broadcast(None)
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
    dist.destroy_process_group()


atexit.register(shutdown)


def worker(rank: int, size: int, init_method: str, ckpt: str, device: torch.device) -> None:
    """Rank `rank`: load this shard, then make every call rank 0 sends until told to stop."""
    _init(rank, size, init_method, device)
    setup = _broadcast()
    if setup is None:  # rank 0 could not load its shard
        dist.destroy_process_group()  # a process that exits inside its group may abort (gloo)
        return
    dtype, num_blocks, block_size, num_host_blocks = setup
    model, _ = load_model(ckpt, device, dtype, Shard(rank, size))
    shape = model.kv_block_shape(block_size)
    kv = KVPool(num_blocks, *shape, dtype, device)
    host = KVPool(num_host_blocks, *shape, dtype, device, host=True) if num_host_blocks else None
    runner = ModelRunner(model, kv)
    swapper = Swapper(kv, host) if host else None
    while (msg := _broadcast()) is not None:
        name, args = msg
        args = [_on(x, device) for x in args]
        if name.startswith("copy_to_"):
            getattr(swapper, name)(*args)
            # rank 0 orders its copies with events; a worker simply finishes each one
            swapper.complete_all()
        else:  # forward, decode or capture
            getattr(runner, name)(*args)
    dist.destroy_process_group()


def _spawned(
    rank: int, size: int, init_method: str, ckpt: str, device: torch.device, parent: int
) -> None:
    """A worker rank 0 started: it ends when rank 0 says so, or is gone."""
    # Ctrl-C and a service manager's SIGTERM reach the whole group: rank 0 drains, then stops us
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if device.type == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    worker(rank, size, init_method, ckpt, device)


def _init(rank: int, size: int, init_method: str, device: torch.device) -> None:
    global control
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    control = weakref.ref(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


def _on(x, device: torch.device):
    """x on this rank's device (a pickled CUDA tensor arrives on the device it left)."""
    if isinstance(x, AttnMetadata):
        return dataclasses.replace(x, **{k: _on(v, device) for k, v in vars(x).items()})
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _broadcast(obj=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control())
    return box[0]


def _watch_workers() -> None:
    while workers:
        for p in list(workers):
            if p.exitcode is not None and p in workers:
                print(
                    f"nanoflow: tensor-parallel worker {p.name} (pid {p.pid}) died with exit "
                    f"code {p.exitcode}; stopping",
                    file=sys.stderr,
                    flush=True,
                )
                for other in workers:
                    other.kill()
                os._exit(1)
        time.sleep(WATCH_INTERVAL_S)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os._exit(1)
