"""The paged KV pool: fixed-size blocks of KV memory, handed to requests as they grow.

One tensor holds every block, block-major (docs/design.md, KV layout). A request's `block_table`
lists its blocks; the scheduler asks the pool for room, and `ModelRunner.run` gets the step's
`slot_mapping` and `block_tables` from `build_metadata`. Prefix caching: a full block is named by a
hash chained over its tokens and its parent's; blocks are reference-counted, and one nobody
references stays cached (LRU) for prompts that start with it. The host pool is the cache's second
tier, nearly exclusive: the cached blocks the device drops move to host (`evicted`, swap.py's
`demote`); host copies of what the device holds go first. It may import attention.
"""

import itertools
import weakref
from collections import OrderedDict, deque

import torch
from torch import Tensor

from .attention import AttnMetadata, cdiv


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class KVPool:
    """KV memory and its block allocator: cached blocks count as free but are taken last."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        host: bool = False,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        if host:  # in CPU memory, pinned for DMA; every block is written before it is read
            self.kv_cache = torch.empty(shape, dtype=dtype)
            if device.type == "cuda":
                self._pin()
        else:  # zeros: padded block-table entries point at block 0 and must read as finite numbers
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.bytes_per_block = kv_block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_hash: dict[int, int] = {}  # block -> hash, for full blocks whose KV is computed
        self.cached: dict[int, int] = {}  # hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.pending_free: list[tuple[torch.cuda.Event, list[int]]] = []  # a copy still reads them
        self.upper_cached: dict[int, int] = {}  # host pool: the device's `cached`
        self.evicted: list[tuple[int, int]] | None = None  # device pool: (block, hash) to demote

    def _pin(self) -> None:
        """Page-lock exactly this pool (pin_memory=True rounds up to a power of two)."""
        cudart = torch.cuda.cudart()
        ptr = self.kv_cache.data_ptr()
        nbytes = self.kv_cache.numel() * self.kv_cache.element_size()
        if int(cudart.cudaHostRegister(ptr, nbytes, 0)) != 0:  # cudaSuccess
            raise RuntimeError(
                f"could not pin {nbytes / 2**30:.1f} GiB of host KV memory; lower host_kv_gb"
            )
        weakref.finalize(self, cudart.cudaHostUnregister, ptr)

    def layer_caches(self) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]."""
        return [(layer[:, 0], layer[:, 1]) for layer in self.kv_cache.unbind(1)]

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(block_table))

    def num_full(self, block_table: list[int], num_tokens: int) -> int:
        return min(num_tokens // self.block_size, len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend block_table in place to hold num_tokens; False (nothing taken) if short."""
        if num_tokens <= len(block_table) * self.block_size:
            return True  # most decode steps: a hot path of every schedule() call
        need = self.blocks_needed(block_table, num_tokens)
        if need > self.num_free:
            return False
        block_table.extend(self._take() for _ in range(need))
        return True

    def _take(self) -> int:
        """A free block, else the least recently used cached one (forgetting its hash)."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            h = self.block_hash.pop(block)
            del self.cached[h]
            if self.evicted is not None:
                self.evicted.append((block, h))
        self.ref_cnt[block] = 1
        return block

    def free(self, block_table: list[int], after: torch.cuda.Event | None = None) -> None:
        """Drop references; unheld blocks return, tail first (LRU), once `after` is done."""
        for block in block_table:
            self.ref_cnt[block] -= 1
        released = [block for block in reversed(block_table) if self.ref_cnt[block] == 0]
        if after is None:
            self._release(released)
        elif released:
            self.pending_free.append((after, released))
        block_table.clear()

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            if block in self.block_hash:
                self.evictable[block] = None
                if self.block_hash[block] in self.upper_cached:  # a copy: the first to go
                    self.evictable.move_to_end(block, last=False)
            else:
                self.free_blocks.append(block)

    def num_own(self, block_table: list[int]) -> int:
        """Blocks that freeing this table would really free: those nobody else references."""
        return sum(self.ref_cnt[b] == 1 for b in block_table)

    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Cached blocks of the longest leading run of these hashes, each referenced again."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            # a block referenced by nobody but not evictable is pending: a copy still reads it
            if block is None or not (self.ref_cnt[block] or block in self.evictable):
                break
            blocks.append(block)
        for block in blocks:
            self.evictable.pop(block, None)
            self.ref_cnt[block] += 1
        return blocks

    def cache_blocks(self, blocks: list[int], hashes: list[int]) -> None:
        """Name full blocks by their hashes; a hash cached already keeps its first block."""
        for block, h in zip(blocks, hashes):
            if block not in self.block_hash and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block

    def touch(self, block: int) -> None:
        """An unreferenced cached block was just used: the last to be evicted."""
        if block in self.evictable:
            self.evictable.move_to_end(block)

    def release_pending(self) -> None:
        done = [(e, b) for e, b in self.pending_free if e.query()]
        for item in done:
            self.pending_free.remove(item)
            self._release(item[1])


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list on the device through pinned memory, so that the host does not wait."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def build_metadata(
    block_tables: list[list[int]],
    num_computed: list[int],
    query_lens: list[int],
    num_decodes: int,
    block_size: int,
    device: torch.device,
) -> tuple[AttnMetadata, Tensor]:
    """Metadata and positions: sequence i adds query_lens[i] tokens at num_computed[i]."""
    positions, slots = [], []
    for table, start, n in zip(block_tables, num_computed, query_lens):
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    seq_lens = [c + n for c, n in zip(num_computed, query_lens)]
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = list(itertools.accumulate(query_lens, initial=0))
    meta = AttnMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(padded, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        query_start_loc=to_device(starts, torch.int32, device),
        num_decodes=num_decodes,
        query_lens=list(query_lens),
        seq_lens_list=seq_lens,
    )
    return meta, to_device(positions, torch.int64, device)
