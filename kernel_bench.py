"""Decode attention kernel at Llama-3-8B shapes, against the card's own memory bandwidth.

Decode attention is memory bound: each step reads every context token's K and V once, so the
figure of merit is achieved bytes/s next to what a plain device-to-device copy reaches.
Needs a CUDA GPU. (To be folded into bench.py.)
"""

import statistics

import torch

from nanoflow.attention import decode_attention_triton

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16  # Llama-3-8B attention
BATCHES, CONTEXTS = (1, 32, 128), (512, 2048, 8192)
WARMUP, ITERS = 5, 20
L2_FLUSH_BYTES = 256 * 2**20  # written before each timed call, so small contexts are not served from L2
COPY_BYTES = 2**30


def cuda_time(fn) -> float:
    """Median seconds of one call of fn, timed with CUDA events, L2 flushed before each call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    for _ in range(WARMUP):
        fn()
    events = []
    for _ in range(ITERS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / cuda_time(lambda: dst.copy_(src))


def bench_decode_kernel() -> None:
    """Print time and achieved bandwidth of one decode attention call per (batch, context)."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_kernel needs a CUDA GPU")
    peak = copy_bandwidth()
    print(f"device copy bandwidth: {peak / 1e9:.0f} GB/s (read + write)")
    print(f"{'batch':>5} {'context':>7} {'time us':>9} {'GB/s':>7} {'of copy':>7}")
    for batch in BATCHES:
        for context in CONTEXTS:
            blocks_per_seq = context // BLOCK_SIZE
            num_blocks = batch * blocks_per_seq
            # one layer of the block-major pool; every block belongs to exactly one sequence, in random order
            pool = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            block_tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            seconds = cuda_time(lambda: decode_attention_triton(q, pool[:, 0, 0], pool[:, 0, 1], block_tables,
                                                                seq_lens, context, HEAD_DIM ** -0.5))
            nbytes = pool.numel() * pool.element_size() + 2 * q.numel() * q.element_size()  # K + V, q, out
            print(f"{batch:>5} {context:>7} {seconds * 1e6:>9.1f} {nbytes / seconds / 1e9:>7.0f} "
                  f"{nbytes / seconds / peak:>7.0%}")


if __name__ == "__main__":
    bench_decode_kernel()
