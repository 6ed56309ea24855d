"""What the GPU check times on a CUDA device: the decode attention kernel against a plain device
copy (`bench_kernels`), the Swapper's copies against one raw pinned copy and a decode step beside
write-through (`bench_transfers`), and a random Llama-3-8B's decode steps against their bandwidth
floor (`bench_decode_speed`); and the timers these share with the tools (`cuda_time`, `seconds`).
"""

import functools
import itertools
import random
import statistics
import time
from collections import deque
from types import SimpleNamespace

import torch

from benchmarks.runs import free_device_memory
from benchmarks.sim import LLAMA3_8B, kv_bytes_per_token
from benchmarks.workloads import BLOCK_SIZE
from nanoflow.attention import decode_attention_triton
from nanoflow.runner import DecodeGraphs
from nanoflow.kv import KVPool, build_metadata
from nanoflow.model import Transformer, rope_inv_freq
from nanoflow.swap import Swapper

KERNEL_BATCHES, KERNEL_CONTEXTS = (1, 32, 128), (512, 2048, 8192)  # decode speed: the same batches
WARMUP, ITERS = 3, 10
L2_FLUSH_BYTES = 256 << 20  # written before each timed call, so small inputs are not served from L2
COPY_BYTES = 1 << 30
TRANSFER_BYTES = 2 << 30  # KV moved per transfer measurement
DECODE_BATCH, DECODE_CONTEXT = 64, 1024


def cuda_time(fn) -> float:
    """Median seconds of one call of fn on the current stream, L2 flushed before each call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(WARMUP):
        fn()
    events = [[torch.cuda.Event(enable_timing=True) for _ in "se"] for _ in range(ITERS)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def seconds(fn, clock=time.perf_counter) -> float:
    """Seconds of one call of fn: wall-clock, or this process's CPU time (time.process_time)."""
    start = clock()
    fn()
    return clock() - start


def copy_bandwidth() -> float:
    """Bytes/s (read + write) of one big device-to-device copy: what other rates are held to."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / cuda_time(lambda: dst.copy_(src))


def bench_kernels() -> dict:
    """Decode attention at Llama-3-8B shapes, in bytes/s next to a plain device-to-device copy."""
    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    peak = copy_bandwidth()
    rows = []
    print(f"device copy bandwidth: {peak / 1e9:.0f} GB/s (read + write)")
    print(f"{'batch':>5} {'context':>7} {'time us':>9} {'GB/s':>7} {'of copy':>7}")
    for batch, context in itertools.product(KERNEL_BATCHES, KERNEL_CONTEXTS):
        blocks = batch * context // BLOCK_SIZE  # each block in one sequence, in random order
        pool = torch.randn(blocks, 2, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device="cuda")
        tables = torch.randperm(blocks, device="cuda").view(batch, -1).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
        attend = functools.partial(
            decode_attention_triton,
            q,
            pool[:, 0],
            pool[:, 1],
            tables,
            lens,
            context,
            head_dim**-0.5,
        )
        s = cuda_time(attend)
        nbytes = (pool.numel() + 2 * q.numel()) * q.element_size()  # K + V, q and the output
        share = nbytes / s / peak
        print(f"{batch:>5} {context:>7} {s * 1e6:>9.1f} {nbytes / s / 1e9:>7.0f} {share:>7.0%}")
        rows.append(dict(batch=batch, context=context, seconds=s, share_of_copy=share))
    worst = min(r["share_of_copy"] for r in rows if r["batch"] >= 32 and r["context"] >= 2048)
    return dict(
        copy_bytes_per_s=peak,
        rows=rows,
        summary=f"decode kernel >= {worst:.0%} of copy "
        "bandwidth at batch >= 32, context >= 2k (target 70%)",
    )


def llama_pool(num_blocks: int, device: str, host: bool = False) -> KVPool:
    return KVPool(
        num_blocks,
        LLAMA3_8B.num_hidden_layers,
        BLOCK_SIZE,
        LLAMA3_8B.num_key_value_heads,
        LLAMA3_8B.head_dim,
        torch.bfloat16,
        torch.device(device),
        host=host,
    )


def llama_swapper(num_blocks: int, device: str = "cuda") -> Swapper:
    return Swapper(llama_pool(num_blocks, device), llama_pool(num_blocks, device, host=True))


def fake_request(block_table: list[int], num_computed_tokens: int) -> SimpleNamespace:
    """What the Swapper reads of a request."""
    return SimpleNamespace(
        block_table=block_table,
        host_block_table=[],
        num_host_tokens=0,
        num_computed_tokens=num_computed_tokens,
        block_hashes=[],
    )


def swapper_bandwidth(sw: Swapper) -> tuple[float, float]:
    """Bytes/s of evicting every device block, scattered, to host, and of loading them all back."""
    blocks = sw.device.num_blocks
    sw.device.free_blocks = deque(random.sample(range(blocks), blocks))
    req = fake_request([], blocks * BLOCK_SIZE)
    sw.device.grow(req.block_table, req.num_computed_tokens)

    def evict() -> None:
        sw.forget(req)  # the host copy first, so that every block is copied again
        sw.evict(req)
        sw.complete_all()

    def load() -> None:
        sw.load(req)
        sw.complete_all()
        torch.cuda.synchronize()

    rounds = [(seconds(evict), seconds(load)) for _ in range(1 + ITERS // 2)][1:]  # 1st: warm-up
    return tuple(blocks * sw.block_bytes / statistics.median(t) for t in zip(*rounds))


def bench_transfers() -> dict:
    """The Swapper's copies against one raw pinned copy_; decode beside write-through."""
    block_bytes = BLOCK_SIZE * kv_bytes_per_token(LLAMA3_8B, torch.bfloat16)
    sw = llama_swapper(TRANSFER_BYTES // block_bytes)
    nbytes = sw.device.num_blocks * sw.block_bytes
    ours = swapper_bandwidth(sw)
    del sw
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = (
        nbytes / cuda_time(lambda: pinned.copy_(dev, non_blocking=True)),
        nbytes / cuda_time(lambda: dev.copy_(pinned, non_blocking=True)),
    )
    print(
        f"{nbytes / 1e9:.1f} GB of Llama-3-8B KV in {BLOCK_SIZE}-token blocks, scattered, vs "
        f"one pinned copy_\n{'direction':>13} {'Swapper GB/s':>13} {'raw GB/s':>9} {'share':>6}"
    )
    for name, x, y in zip(("device->host", "host->device"), ours, raw):
        print(f"{name:>13} {x / 1e9:>13.1f} {y / 1e9:>9.1f} {x / y:>6.0%}")
    shares = (ours[0] / raw[0], ours[1] / raw[1])
    slowdown = bench_decode_beside_write_through()
    return dict(
        to_host_share=shares[0],
        to_device_share=shares[1],
        write_through_slowdown=slowdown,
        summary=f"swap {min(shares):.0%} of a raw pinned copy (target 80%); write-through "
        f"slows decode by {slowdown:.1%} (target <= 5%)",
    )


def random_model(device: str) -> Transformer:
    """Llama-3-8B's shape with random bf16 weights: timing needs no checkpoint."""
    with torch.device("meta"):
        model = Transformer(LLAMA3_8B).to(torch.bfloat16)
    model.to_empty(device=device)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.inv_freq = rope_inv_freq(LLAMA3_8B).to(device)
    return model.eval()


def decode_forward(
    model: Transformer, pool: KVPool, batch: int, context: int, graphs: bool = False
):
    """A decode step's forward over `batch` sequences of `context` tokens, and their tables."""
    device = pool.kv_cache.device
    per_seq = context // BLOCK_SIZE
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta, positions = build_metadata(
        tables, [context - 1] * batch, [1] * batch, batch, BLOCK_SIZE, device
    )
    ids = torch.randint(model.config.vocab_size, (batch,), device=device)
    rows = torch.arange(batch, device=device)
    caches = pool.layer_caches()
    if graphs:
        runner = DecodeGraphs(
            model, caches, [batch], model.config.max_position_embeddings, BLOCK_SIZE, capture=True
        )
        return (lambda: runner.run(ids, positions, meta)), tables
    return (lambda: model(ids, positions, caches, meta, rows)), tables


def bench_decode_speed(device: str = "cuda") -> dict:
    """Decode tokens/s of a random Llama-3-8B in bf16 at each batch, against its bandwidth floor:
    the weights and the batch's KV read once per step at the measured copy rate."""
    model = random_model(device)
    peak = copy_bandwidth()
    rows = []
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for batch, mode in itertools.product(KERNEL_BATCHES, ("eager", "graphs")):
        pool = llama_pool(batch * DECODE_CONTEXT // BLOCK_SIZE, device)
        floor = (weights + pool.kv_cache.numel() * pool.kv_cache.element_size()) / peak
        s = cuda_time(decode_forward(model, pool, batch, DECODE_CONTEXT, mode == "graphs")[0])
        rows.append(
            dict(
                batch=batch,
                context=DECODE_CONTEXT,
                mode=mode,
                tokens_per_s=batch / s,
                share_of_floor=floor / s,
            )
        )
        print(
            f"decode batch {batch:>3}, {mode}: {batch / s:>8.0f} tok/s, {floor / s:.0%} of the "
            "bandwidth floor"
        )
        del pool
        free_device_memory()
    shares = [f"batch {r['batch']} {r['mode']} {r['share_of_floor']:.0%}" for r in rows]
    return dict(
        rows=rows,
        summary=f"share of the bandwidth floor: {', '.join(shares)} (target: "
        "batch 1 with graphs >= 90%)",
    )


def bench_decode_beside_write_through(device: str = "cuda") -> float:
    """One decode step at batch 64, alone and right after a step's write-through is queued."""
    sw = llama_swapper(DECODE_BATCH * DECODE_CONTEXT // BLOCK_SIZE, device)
    forward, tables = decode_forward(random_model(device), sw.device, DECODE_BATCH, DECODE_CONTEXT)
    reqs = [fake_request(t, DECODE_CONTEXT - 1) for t in tables]

    def step() -> None:  # the compute stream only: copies may still be running
        forward()
        torch.cuda.current_stream().synchronize()

    def write_through_then_step() -> float:
        sw.complete_all()
        for r in reqs:
            sw.forget(r)  # so that there is always something to write

        def write_through_and_step() -> None:  # as the engine does
            sw.write_through(reqs, max_blocks)
            step()

        return seconds(write_through_and_step)

    alone = statistics.median(seconds(step) for _ in range(ITERS))
    max_blocks = max(1, int(alone * sw.bandwidth / sw.block_bytes))  # as Scheduler.after_step
    beside = statistics.median(write_through_then_step() for _ in range(ITERS))
    print(
        f"decode step, Llama-3-8B shape, batch {DECODE_BATCH}, context {DECODE_CONTEXT}: "
        f"{alone * 1e3:.1f} ms alone; {beside * 1e3:.1f} ms with a write-through of {max_blocks} "
        f"blocks ({max_blocks * sw.block_bytes / 1e6:.0f} MB) queued before it"
    )
    return beside / alone - 1
