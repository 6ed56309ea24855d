"""Host KV memory and the copies that make preemption nearly free (TokenFlow's proactive KV).

A host pool (kv.py's layout, in CPU memory) takes the blocks running requests fill, after a step,
so preempting a request copies only its unsynced tail; resuming loads it into fresh device blocks.
Full blocks keep their prefix-cache hashes on host: a second cache tier, which also takes the
cached blocks the device drops (`demote`). On CUDA copies run on a side stream through two staging
buffers (docs/design.md); on CPU every copy completes at once.
"""

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kv import KVPool, cdiv, to_device

STAGING_BYTES = 64 << 20  # per staging buffer: big DMAs run at full link speed
BANDWIDTH_GUESS = {"cuda": 20e9, "cpu": 5e9}  # bytes/s until the first copy is measured
BANDWIDTH_EMA = 0.2  # weight of the newest measurement in the running estimate


@dataclass(eq=False)
class Transfer:
    """A chunk in flight; `finish` never holds the Swapper (a cycle would keep both pools alive)."""

    nbytes: int
    finish: Callable[[], None]
    start: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None


class Swapper:
    """Moves whole KV blocks between the device pool and the host pool, and keeps their books."""

    def __init__(self, device: KVPool, host: KVPool):
        self.device = device
        self.host = host
        self.block_bytes = device.bytes_per_block
        cache = device.kv_cache
        self.on_cuda = self.async_copies = cache.is_cuda
        self.stream = torch.cuda.Stream(cache.device) if self.on_cuda else None
        self.chunk_blocks = max(1, min(STAGING_BYTES // self.block_bytes, host.num_blocks))
        shape = (self.chunk_blocks, *cache.shape[1:])
        self.staging = [(torch.empty(shape, dtype=cache.dtype, device=cache.device),
                         torch.empty(shape, dtype=cache.dtype, pin_memory=self.on_cuda))
                        for _ in range(2)]
        self.last_use: list[Transfer | None] = [None, None]  # the last transfer of each slot
        self.slot = 0
        self.in_flight: deque[Transfer] = deque()
        self.queued_bytes = 0  # issued and not finished yet
        self.bandwidth = BANDWIDTH_GUESS["cuda" if self.on_cuda else "cpu"]
        self.counters: Counter[str] = Counter()
        self.link_tiers()

    def link_tiers(self) -> None:
        """The host tier learns what the device caches and what it drops."""
        self.device.evicted = []
        self.host.upper_cached = self.device.cached

    def write_through(self, reqs: list, max_blocks: int) -> None:
        """Copy reqs' filled, unsynced blocks to host, in order; host-cached ones are shared."""
        bs = self.device.block_size
        for req in reqs:
            start = req.num_host_tokens // bs
            end = self.device.num_full(req.block_table, req.num_computed_tokens)
            if end <= start:
                continue  # nothing filled since its last copy: most requests, most steps
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
        """Free req's device blocks, copying what is not on host yet; False if the host is full."""
        start = req.num_host_tokens // self.device.block_size
        if not self._copy_out(req, start, req.num_computed_tokens):
            return False
        self.device.free(req.block_table, after=self.pending_event())
        return True

    def _copy_out(self, req, start: int, num_tokens: int) -> bool:
        """Copy req's blocks from `start` up to num_tokens to host; False if the host is full."""
        if not self.host.grow(req.host_block_table, num_tokens):
            return False
        bs = self.device.block_size
        end = cdiv(num_tokens, bs)
        full = num_tokens // bs
        self._to_host(req.block_table[start:end], req.host_block_table[start:end])
        req.num_host_tokens = num_tokens
        self.host.cache_blocks(req.host_block_table[start:full], req.block_hashes[start:full])
        return True

    def load(self, req) -> bool:
        """Copy req's KV back into fresh device blocks; False (nothing taken) if short."""
        if not self.device.grow(req.block_table, req.num_host_tokens):
            return False
        n = cdiv(req.num_host_tokens, self.device.block_size)
        self._load(req, req.host_block_table[:n], req.block_table[:n])
        req.num_computed_tokens = req.num_host_tokens
        return True

    def load_prefix(self, req, hashes: list[int], worth: Callable[[int], bool]) -> int:
        """Load the leading blocks of `hashes` cached on host, if worth(their tokens); how many."""
        bs = self.device.block_size
        host_blocks = self.host.match_prefix(hashes)
        n = len(host_blocks)
        grown = len(req.block_table) + n
        if n and worth(n * bs) and self.device.grow(req.block_table, grown * bs):
            self._load(req, host_blocks, req.block_table[-n:])
            req.num_computed_tokens += n * bs
        else:
            n = 0
        self.host.free(host_blocks, after=self.pending_event())
        return n

    def demote(self) -> None:
        """Copy to host the cached blocks the device dropped since the last call, before anything
        overwrites them: the two tiers together are one LRU cache."""
        blocks, host_blocks, hashes = [], [], []
        for block, h in self.device.evicted:
            if h in self.host.cached:
                self.host.touch(self.host.cached[h])
            elif self.host.grow(host_blocks, (len(host_blocks) + 1) * self.host.block_size):
                blocks.append(block)
                hashes.append(h)
        self.device.evicted.clear()
        if blocks:
            self._to_host(blocks, host_blocks)
            self.host.cache_blocks(host_blocks, hashes)
            # free() releases tail first: reversed, the least recently used block goes first
            self.host.free(host_blocks[::-1], after=self.pending_event())
            self.counters["blocks_demoted"] += len(blocks)

    def _load(self, req, host_ids: list[int], dev_ids: list[int]) -> None:
        """Copy host blocks into req's, after the copies to host (they may carry these blocks)."""
        self.demote()
        self._drain()
        req.load_event = self._to_device(host_ids, dev_ids)

    def forget(self, req) -> None:
        """Drop req's host copy (it finished, was aborted, or will be recomputed)."""
        self.host.free(req.host_block_table, after=self.pending_event())
        req.num_host_tokens = 0

    def release(self, req) -> None:
        self.device.free(req.block_table, after=self.pending_event())
        self.forget(req)

    def backlog(self) -> float:
        """Estimated seconds until the copies issued so far are done."""
        return self.queued_bytes / self.bandwidth

    def transfer_time(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.bandwidth

    def copy_done_in(self, num_blocks: int) -> float:
        return self.backlog() + self.transfer_time(num_blocks)

    def blocks_in(self, seconds: float) -> int:
        """Blocks the link carries in this many seconds (at least one)."""
        return max(1, int(seconds * self.bandwidth / self.block_bytes))

    def poll(self) -> None:
        """Finish the transfers whose DMA is done; free the blocks they were holding."""
        while self.in_flight and self.in_flight[0].done.query():
            self._retire(self.in_flight.popleft())
        self.device.release_pending()
        self.host.release_pending()

    def complete_all(self) -> None:
        """Wait for every copy; every block they held is free again."""
        self._drain()
        for pool in (self.device, self.host):
            for event, _ in pool.pending_free:
                event.synchronize()
            pool.release_pending()

    def pending_event(self) -> torch.cuda.Event | None:
        """The event after which every copy issued so far is done (None if none is in flight)."""
        return self.in_flight[-1].done if self.in_flight else None

    # ------------------------------------------------------------ chunked copies

    def _to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        for lo in range(0, len(dev_ids), self.chunk_blocks):
            src = dev_ids[lo:lo + self.chunk_blocks]
            dev, host = self._claim_slot(len(src))
            # gathered on the compute stream: the next step may overwrite these blocks
            torch.index_select(self.device.kv_cache, 0, self._indices(src), out=dev)

            def scatter(dst=torch.tensor(host_ids[lo:lo + len(src)]), staged=host,
                        pool=self.host.kv_cache):
                pool.index_copy_(0, dst, staged)

            self._copy_chunk("bytes_to_host", len(src),
                             lambda dev=dev, host=host: host.copy_(dev, non_blocking=True), scatter)

    def _to_device(self, host_ids: list[int], dev_ids: list[int]) -> torch.cuda.Event | None:
        for lo in range(0, len(host_ids), self.chunk_blocks):
            src = torch.tensor(host_ids[lo:lo + self.chunk_blocks])
            dev, host = self._claim_slot(len(src))
            torch.index_select(self.host.kv_cache, 0, src, out=host)

            def copy_and_scatter(dst=dev_ids[lo:lo + len(src)], dev=dev, host=host):
                dev.copy_(host, non_blocking=True)
                self.device.kv_cache.index_copy_(0, self._indices(dst), dev)

            self._copy_chunk("bytes_to_device", len(src), copy_and_scatter, lambda: None)
        return self.pending_event()

    def _indices(self, ids: list[int]) -> torch.Tensor:
        return to_device(ids, torch.int64, self.device.kv_cache.device)

    def _claim_slot(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next staging pair (device, host), once its last transfer is done."""
        self.slot ^= 1
        while self.last_use[self.slot] in self.in_flight:
            self._finish_oldest()
        return tuple(stage[:num_blocks] for stage in self.staging[self.slot])

    def _copy_chunk(self, direction: str, num_blocks: int, device_work: Callable[[], None],
                    finish: Callable[[], None]) -> None:
        """One chunk's device-side copies on the side stream; `finish` runs on the host after."""
        self.counters[direction] += num_blocks * self.block_bytes
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
        # the compute stream wrote the blocks
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            transfer.start.record()
            device_work()
            transfer.done.record()
        self.queued_bytes += transfer.nbytes
        self.in_flight.append(transfer)

    def _drain(self) -> None:
        while self.in_flight:
            self._finish_oldest()

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
