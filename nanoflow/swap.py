"""Host KV memory and the copies that make preemption nearly free (TokenFlow's proactive KV management).

A host pool in CPU memory (pinned on CUDA) has the same block layout as the device pool (kv.py).
After every step, blocks that running requests have just filled are written through to it, so when
the scheduler preempts a request (sched.py) only its unsynced tail has to be copied before its
device blocks are free; resuming it is a load of its blocks back into fresh device blocks. Full
blocks keep their prefix-cache hashes (kv.py) on host, so the host pool is a second cache tier: a
prefix the device has dropped comes back by a copy instead of a recompute.

On CUDA the copies run on a side stream: scattered device blocks are gathered into a contiguous
device staging buffer, copied to pinned host memory in one DMA, then scattered into the host pool
(loads run the other way). Two staging buffers alternate, so the host-side scatter of one chunk
overlaps the DMA of the next. Events order everything: the side stream waits for the compute
that wrote the blocks; the compute stream waits only for the loads of requests it is about to run;
freed blocks return to their pool once the copies reading them are done. Nothing synchronizes the
whole device. On CPU the same code runs and every copy completes at once.
"""

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kv import KVPool, cdiv, to_device

STAGING_BYTES = 64 << 20  # per staging buffer: big DMAs run at full link speed; a chunk is what fits
BANDWIDTH_GUESS = {"cuda": 20e9, "cpu": 5e9}  # bytes/s until the first copy is measured
BANDWIDTH_EMA = 0.2  # weight of the newest measurement in the running estimate


@dataclass(eq=False)
class Transfer:
    """One chunk in flight: its size, the events around its DMA and the host-side work that follows.

    `finish` holds tensors, never the Swapper: a Transfer outlives its copy in `last_use`, and a
    cycle back to the Swapper would keep both KV pools alive after their engine is gone.
    """

    nbytes: int
    finish: Callable[[], None]
    start: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None


class Swapper:
    """Moves whole KV blocks between the device pool and the host pool, and keeps their books."""

    def __init__(self, device: KVPool, host: KVPool):
        self.device, self.host = device, host
        self.block_bytes = device.bytes_per_block
        self.on_cuda = self.async_copies = device.kv_cache.is_cuda
        self.stream = torch.cuda.Stream(device.kv_cache.device) if self.on_cuda else None
        self.chunk_blocks = max(1, min(STAGING_BYTES // self.block_bytes, host.num_blocks))
        shape, dtype = (self.chunk_blocks, *device.kv_cache.shape[1:]), device.kv_cache.dtype
        self.staging = [(torch.empty(shape, dtype=dtype, device=device.kv_cache.device),
                         torch.empty(shape, dtype=dtype, pin_memory=self.on_cuda)) for _ in range(2)]
        self.last_use: list[Transfer | None] = [None, None]  # the transfer that last used each staging slot
        self.slot = 0
        self.in_flight: deque[Transfer] = deque()
        self.queued_bytes = 0  # issued and not finished yet
        self.bandwidth = BANDWIDTH_GUESS["cuda" if self.on_cuda else "cpu"]
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------ what the scheduler calls

    def write_through(self, reqs: list, max_blocks: int) -> None:
        """Copy the filled, unsynced blocks of `reqs` (most likely to be preempted first) to host;
        those whose hashes the host pool has cached already are shared, not copied."""
        bs = self.device.block_size
        for req in reqs:
            start, end = req.num_host_tokens // bs, min(req.num_computed_tokens // bs, len(req.block_table))
            if len(req.host_block_table) == start:
                req.host_block_table += self.host.match_prefix(req.block_hashes[start:end])
                start = len(req.host_block_table)
                req.num_host_tokens = start * bs
            n = min(end - start, max_blocks)
            if n <= 0:
                continue
            if not self._copy_out(req, start, (start + n) * bs):
                return  # host pool full: eviction will copy (or recompute) instead
            self.counters["blocks_written_through"] += n
            max_blocks -= n
            if max_blocks == 0:
                return

    def evict(self, req) -> bool:
        """Free req's device blocks, copying only what is not on host yet; False if the host pool is full."""
        start = req.num_host_tokens // self.device.block_size
        if not self._copy_out(req, start, req.num_computed_tokens):
            return False
        self.device.free(req.block_table, after=self.pending_event())
        return True

    def _copy_out(self, req, start: int, num_tokens: int) -> bool:
        """Copy req's blocks from `start` on, up to num_tokens, to host; full ones keep the hashes
        that name them on the device. False (nothing copied) if the host pool is full."""
        if not self.host.grow(req.host_block_table, num_tokens):
            return False
        bs = self.device.block_size
        end, full = cdiv(num_tokens, bs), num_tokens // bs
        self._to_host(req.block_table[start:end], req.host_block_table[start:end])
        req.num_host_tokens = num_tokens
        self.host.cache_blocks(req.host_block_table[start:full], req.block_hashes[start:full])
        return True

    def load(self, req) -> bool:
        """Copy req's KV back into fresh device blocks; False (nothing taken) if the device pool is short."""
        if not self.device.grow(req.block_table, req.num_host_tokens):
            return False
        while self.in_flight:  # its own eviction may still be on its way to host
            self._finish_oldest()
        n = cdiv(req.num_host_tokens, self.device.block_size)
        req.load_event = self._to_device(req.host_block_table[:n], req.block_table[:n])
        req.num_computed_tokens = req.num_host_tokens
        return True

    def load_prefix(self, req, hashes: list[int], worth: Callable[[int], bool]) -> int:
        """Extend req's device KV by the leading blocks of `hashes` that the host pool has cached,
        when worth(their number of tokens) says the copy pays; returns how many blocks it loads."""
        host_blocks, bs = self.host.match_prefix(hashes), self.device.block_size
        n = len(host_blocks)
        loads = n > 0 and worth(n * bs) and \
            self.device.grow(req.block_table, (len(req.block_table) + n) * bs)
        if loads:
            while self.in_flight:  # their blocks may still be on their way to host
                self._finish_oldest()
            req.load_event = self._to_device(host_blocks, req.block_table[-n:])
            req.num_computed_tokens += n * bs
        self.host.free(host_blocks, after=self.pending_event())
        return n if loads else 0

    def forget(self, req) -> None:
        """Drop req's host copy (it finished, was aborted, or will be recomputed)."""
        self.host.free(req.host_block_table, after=self.pending_event())
        req.num_host_tokens = 0

    def release(self, req) -> None:
        """Give back everything req holds in both pools."""
        self.device.free(req.block_table, after=self.pending_event())
        self.forget(req)

    def backlog(self) -> float:
        """Estimated seconds until the copies issued so far are done."""
        return self.queued_bytes / self.bandwidth

    def transfer_time(self, num_blocks: int) -> float:
        """Estimated seconds to copy num_blocks blocks, once the link is free."""
        return num_blocks * self.block_bytes / self.bandwidth

    def poll(self) -> None:
        """Finish the transfers whose DMA is done; free the blocks they were holding."""
        while self.in_flight and self.in_flight[0].done.query():
            self._retire(self.in_flight.popleft())
        self.device.release_pending()
        self.host.release_pending()

    def complete_all(self) -> None:
        """Wait for every copy; every block they held is free again."""
        while self.in_flight:
            self._finish_oldest()
        for pool in (self.device, self.host):
            for event, _ in pool.pending_free:
                event.synchronize()
            pool.release_pending()

    def pending_event(self) -> torch.cuda.Event | None:
        """The event after which every copy issued so far is done (None when nothing is in flight)."""
        return self.in_flight[-1].done if self.in_flight else None

    # ------------------------------------------------------------ chunked copies

    def _to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        for lo in range(0, len(dev_ids), self.chunk_blocks):
            dev_stage, host_stage = self._claim_slot()
            n = min(len(dev_ids) - lo, self.chunk_blocks)
            dst = torch.tensor(host_ids[lo:lo + n])

            def gather_and_copy(src=dev_ids[lo:lo + n], n=n, dev_stage=dev_stage, host_stage=host_stage):
                torch.index_select(self.device.kv_cache, 0, self._indices(src), out=dev_stage[:n])
                host_stage[:n].copy_(dev_stage[:n], non_blocking=True)

            def scatter(dst=dst, staged=host_stage[:n], host=self.host.kv_cache):
                host.index_copy_(0, dst, staged)

            self._copy_chunk(n, gather_and_copy, scatter)
            self.counters["bytes_to_host"] += n * self.block_bytes

    def _to_device(self, host_ids: list[int], dev_ids: list[int]) -> torch.cuda.Event | None:
        for lo in range(0, len(host_ids), self.chunk_blocks):
            dev_stage, host_stage = self._claim_slot()
            n = min(len(host_ids) - lo, self.chunk_blocks)
            torch.index_select(self.host.kv_cache, 0, torch.tensor(host_ids[lo:lo + n]), out=host_stage[:n])

            def copy_and_scatter(dst=dev_ids[lo:lo + n], n=n, dev_stage=dev_stage, host_stage=host_stage):
                dev_stage[:n].copy_(host_stage[:n], non_blocking=True)
                self.device.kv_cache.index_copy_(0, self._indices(dst), dev_stage[:n])

            self._copy_chunk(n, copy_and_scatter, lambda: None)
            self.counters["bytes_to_device"] += n * self.block_bytes
        return self.pending_event()

    def _indices(self, ids: list[int]) -> torch.Tensor:
        return to_device(ids, torch.int64, self.device.kv_cache.device)

    def _claim_slot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next staging pair, once the transfer that used it last has finished."""
        self.slot ^= 1
        while self.last_use[self.slot] in self.in_flight:
            self._finish_oldest()
        return self.staging[self.slot]

    def _copy_chunk(self, num_blocks: int, device_work: Callable[[], None], finish: Callable[[], None]) -> None:
        """Run one chunk's device-side copies on the side stream; `finish` runs on the host once they are done."""
        transfer = Transfer(num_blocks * self.block_bytes, finish)
        self.last_use[self.slot] = transfer
        if not self.on_cuda:  # synchronous: everything is done on return
            start = time.perf_counter()
            device_work()
            finish()
            self._measured(transfer.nbytes, time.perf_counter() - start)
            return
        transfer.start = torch.cuda.Event(enable_timing=True)
        transfer.done = torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the compute stream wrote the blocks
        with torch.cuda.stream(self.stream):
            transfer.start.record()
            device_work()
            transfer.done.record()
        self.queued_bytes += transfer.nbytes
        self.in_flight.append(transfer)

    def _finish_oldest(self) -> None:
        t = self.in_flight.popleft()
        t.done.synchronize()
        self._retire(t)

    def _retire(self, t: Transfer) -> None:
        """The host side of a chunk whose DMA is done, and its measured bandwidth."""
        t.finish()
        self.queued_bytes -= t.nbytes
        self._measured(t.nbytes, t.start.elapsed_time(t.done) / 1e3)

    def _measured(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.bandwidth += BANDWIDTH_EMA * (nbytes / seconds - self.bandwidth)
