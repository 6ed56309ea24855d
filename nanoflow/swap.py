"""Host KV memory and the copies that make preemption nearly free (TokenFlow's proactive KV).

A host pool (kv.py's layout, in CPU memory) takes the blocks running requests fill, after a
step, so preempting a request copies only its unsynced tail; resuming loads it into fresh
device blocks. Full blocks keep their prefix-cache hashes on host: a second cache tier, which
also takes the cached blocks the device drops (`demote`). On CUDA copies run on side streams,
one per direction (the link is full duplex: a load never waits behind evictions), each through
two staging buffers (docs/design.md); on CPU every copy completes at once. It may import kv.
"""

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kv import KVPool, cdiv, to_device

STAGING_BYTES = 64 << 20  # per staging buffer: big DMAs run at full link speed
BANDWIDTH_GUESS = {"cuda": 20e9, "cpu": 5e9}  # bytes/s until the first copy is measured
BANDWIDTH_EMA = 0.2  # weight of the newest measurement in the running estimate


@dataclass(eq=False)
class Transfer:
    """A chunk in flight; `finish` never holds the Swapper (a cycle keeps the pools alive)."""

    nbytes: int
    finish: Callable[[], None]
    host_ids: list[int] = field(default_factory=list)  # the host blocks a copy to host fills
    start: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None


@dataclass(eq=False)
class Lane:
    """One direction of the link: its stream, two staging slots in turn, its chunks in flight."""

    stream: torch.cuda.Stream | None
    staging: list[tuple[torch.Tensor, torch.Tensor]]  # per slot: (device, pinned host)
    last_use: list[Transfer | None] = field(default_factory=lambda: [None, None])  # per slot
    slot: int = 0
    in_flight: deque[Transfer] = field(default_factory=deque)  # oldest first
    queued_bytes: int = 0  # issued and not finished yet


@dataclass
class AllDone:
    """Done once every event is: what a block freed after copies in both directions waits for."""

    events: list

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


class Swapper:
    """Moves whole KV blocks between the device pool and the host pool, and keeps their books.
    Every copy goes through `copy_to_host` or `copy_to_device`: the seam the simulator overrides."""

    def __init__(self, device: KVPool, host: KVPool, ranks=None):
        self.device = device
        self.host = host
        self.ranks = ranks
        self.block_bytes = device.bytes_per_block
        cache = device.kv_cache
        self.on_cuda = self.async_copies = cache.is_cuda
        self.chunk_blocks = max(1, min(STAGING_BYTES // self.block_bytes, host.num_blocks))
        self.out, self.back = self._lane(cache), self._lane(cache)  # to host, to device
        self.writing: dict[int, Transfer] = {}  # host block -> the copy to host that fills it
        self.bandwidth = BANDWIDTH_GUESS["cuda" if self.on_cuda else "cpu"]
        self.counters: Counter[str] = Counter()
        self.link_tiers()

    def _lane(self, cache: torch.Tensor) -> Lane:
        shape = (self.chunk_blocks, *cache.shape[1:])
        staging = [
            (
                torch.empty(shape, dtype=cache.dtype, device=cache.device),
                torch.empty(shape, dtype=cache.dtype, pin_memory=self.on_cuda),
            )
            for _ in range(2)
        ]
        return Lane(torch.cuda.Stream(cache.device) if self.on_cuda else None, staging)

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
        """Free req's device blocks, copying what host lacks; False if the host is full."""
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
        self.copy_to_host(req.block_table[start:end], req.host_block_table[start:end])
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
        """Load the leading host-cached blocks of `hashes` if worth(tokens); how many."""
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
        """Copy to host the cached blocks the device dropped since the last call, before
        anything overwrites them: the two tiers together are one LRU cache."""
        blocks, host_blocks, hashes = [], [], []
        for block, h in self.device.evicted:
            if h in self.host.cached:
                self.host.touch(self.host.cached[h])
            elif self.host.grow(host_blocks, (len(host_blocks) + 1) * self.host.block_size):
                blocks.append(block)
                hashes.append(h)
        self.device.evicted.clear()
        if blocks:
            self.copy_to_host(blocks, host_blocks)
            self.host.cache_blocks(host_blocks, hashes)
            # free() releases tail first: reversed, the least recently used block goes first
            self.host.free(host_blocks[::-1], after=self.pending_event())
            self.counters["blocks_demoted"] += len(blocks)

    def _load(self, req, host_ids: list[int], dev_ids: list[int]) -> None:
        """Copy host blocks into req's once the copies that fill them are done (no others)."""
        self.demote()  # gathered before the load may overwrite the device blocks it drops
        while any(h in self.writing for h in host_ids):
            self._finish_oldest(self.out)
        req.load_event = self.copy_to_device(host_ids, dev_ids)

    def forget(self, req) -> None:
        """Drop req's host copy (it finished, was aborted, or will be recomputed)."""
        self.host.free(req.host_block_table, after=self.pending_event())
        req.num_host_tokens = 0

    def release(self, req) -> None:
        self.device.free(req.block_table, after=self.pending_event())
        self.forget(req)

    def backlog(self, lane: Lane | None = None) -> float:
        """Estimated seconds until the copies issued so far (on one lane, or both) are done."""
        lanes = [lane] if lane else [self.out, self.back]
        return max(x.queued_bytes for x in lanes) / self.bandwidth

    def transfer_time(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.bandwidth

    def copy_done_in(self, num_blocks: int) -> float:
        """Seconds until a load of num_blocks issued now is done (behind other loads only)."""
        return self.backlog(self.back) + self.transfer_time(num_blocks)

    def blocks_in(self, seconds: float) -> int:
        return max(1, int(seconds * self.bandwidth / self.block_bytes))

    def poll(self) -> None:
        """Finish the transfers whose DMA is done; free the blocks they were holding."""
        for lane in (self.out, self.back):
            while lane.in_flight and lane.in_flight[0].done.query():
                self._retire(lane, lane.in_flight.popleft())
        self.device.release_pending()
        self.host.release_pending()

    def complete_all(self) -> None:
        """Wait for every copy; every block they held is free again."""
        for lane in (self.out, self.back):
            while lane.in_flight:
                self._finish_oldest(lane)
        for pool in (self.device, self.host):
            for event, _ in pool.pending_free:
                event.synchronize()
            pool.release_pending()

    def pending_event(self) -> AllDone | None:
        """Done once every copy issued so far is (None if none is in flight)."""
        last = [lane.in_flight[-1].done for lane in (self.out, self.back) if lane.in_flight]
        return AllDone(last) if last else None

    # ------------------------------------------------------------ chunked copies

    def copy_to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        """Issue copies of device blocks into host blocks (given `ranks`, on every rank)."""
        if self.ranks:
            self.ranks.send("copy_to_host", dev_ids, host_ids)
        for lo in range(0, len(dev_ids), self.chunk_blocks):
            src, dst = dev_ids[lo : lo + self.chunk_blocks], host_ids[lo : lo + self.chunk_blocks]
            dev, host = self._claim_slot(self.out, len(src))
            # gathered on the compute stream: the next step may overwrite these blocks
            torch.index_select(self.device.kv_cache, 0, self._indices(src), out=dev)

            def scatter(dst=torch.tensor(dst), staged=host, pool=self.host.kv_cache):
                pool.index_copy_(0, dst, staged)

            def copy(dev=dev, host=host):
                host.copy_(dev, non_blocking=True)

            transfer = self._copy_chunk(self.out, "bytes_to_host", len(src), copy, scatter)
            if transfer:
                transfer.host_ids = dst
                self.writing.update(dict.fromkeys(dst, transfer))

    def copy_to_device(self, host_ids: list[int], dev_ids: list[int]) -> torch.cuda.Event | None:
        """Likewise into the device; returns the last copy's event (None if none is in flight)."""
        if self.ranks:
            self.ranks.send("copy_to_device", host_ids, dev_ids)
        for lo in range(0, len(host_ids), self.chunk_blocks):
            src = torch.tensor(host_ids[lo : lo + self.chunk_blocks])
            dev, host = self._claim_slot(self.back, len(src))
            torch.index_select(self.host.kv_cache, 0, src, out=host)

            def copy_and_scatter(dst=dev_ids[lo : lo + len(src)], dev=dev, host=host):
                dev.copy_(host, non_blocking=True)
                self.device.kv_cache.index_copy_(0, self._indices(dst), dev)

            self._copy_chunk(self.back, "bytes_to_device", len(src), copy_and_scatter, lambda: None)
        return self.back.in_flight[-1].done if self.back.in_flight else None

    def _indices(self, ids: list[int]) -> torch.Tensor:
        return to_device(ids, torch.int64, self.device.kv_cache.device)

    def _claim_slot(self, lane: Lane, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The lane's next staging pair (device, host), once its last transfer is done."""
        lane.slot ^= 1
        while lane.last_use[lane.slot] in lane.in_flight:
            self._finish_oldest(lane)
        return tuple(stage[:num_blocks] for stage in lane.staging[lane.slot])

    def _copy_chunk(
        self,
        lane: Lane,
        direction: str,
        num_blocks: int,
        device_work: Callable[[], None],
        finish: Callable[[], None],
    ) -> Transfer | None:
        """One chunk's copies on the lane's stream; `finish` runs on the host after."""
        self.counters[direction] += num_blocks * self.block_bytes
        transfer = Transfer(num_blocks * self.block_bytes, finish)
        lane.last_use[lane.slot] = transfer
        if not self.on_cuda:
            start = time.perf_counter()
            device_work()
            finish()
            self._measured(transfer.nbytes, time.perf_counter() - start)
            return None
        transfer.start = torch.cuda.Event(enable_timing=True)
        transfer.done = torch.cuda.Event(enable_timing=True)
        # the compute stream wrote the blocks
        lane.stream.wait_stream(torch.cuda.current_stream(lane.stream.device))
        with torch.cuda.stream(lane.stream):
            transfer.start.record()
            device_work()
            transfer.done.record()
        lane.queued_bytes += transfer.nbytes
        lane.in_flight.append(transfer)
        return transfer

    def _finish_oldest(self, lane: Lane) -> None:
        t = lane.in_flight.popleft()
        t.done.synchronize()
        self._retire(lane, t)

    def _retire(self, lane: Lane, t: Transfer) -> None:
        """The host side of a chunk whose DMA is done, and its measured bandwidth."""
        t.finish()
        for h in t.host_ids:
            if self.writing.get(h) is t:
                del self.writing[h]
        lane.queued_bytes -= t.nbytes
        self._measured(t.nbytes, t.start.elapsed_time(t.done) / 1e3)

    def _measured(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.bandwidth += BANDWIDTH_EMA * (nbytes / seconds - self.bandwidth)
