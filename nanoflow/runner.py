"""The model runner: a step's batch in, the logits of its sampled requests out.

Every rank holds one `ModelRunner` (its model shard, KV caches and decode graphs). Under tensor
parallelism rank 0's runner first sends each call to the other ranks (`ranks.send`, dist.py), whose
loops call the same method of their own. It may import attention, kv, model and request.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import AttnMetadata
from .kv import KVPool, build_metadata, cdiv, to_device
from .model import Transformer
from .request import Request

GRAPH_BATCH_STEP = 8  # decode batches captured in CUDA graphs: 1, 2, 4, then every multiple of this


class ModelRunner:
    """This rank's model on its KV pool; `ranks` (rank 0's) has other ranks make each call."""

    def __init__(self, model: Transformer, kv: KVPool, ranks=None):
        self.model = model
        self.kv_caches = kv.layer_caches()
        self.block_size = kv.block_size
        self.device = kv.kv_cache.device
        self.ranks = ranks
        self.graphs: DecodeGraphs | None = None

    def run(self, batch: "Batch") -> Tensor:
        """The logits of `batch.sampled`: one forward over the flat batch, or a decode graph."""
        reqs = batch.reqs
        computed = [req.num_computed_tokens for req in reqs]
        tables = [r.block_table for r in reqs]
        meta, positions = build_metadata(
            tables, computed, batch.query_lens, batch.num_decodes, self.block_size, self.device
        )
        input_ids = [
            t for r, c, n in zip(reqs, computed, batch.query_lens) for t in r.token_ids[c : c + n]
        ]
        ids = to_device(input_ids, torch.long, self.device)
        if self.graphs and meta.num_decodes == len(batch.sampled) == len(reqs):
            return self.decode(ids, positions, meta)
        ends = dict(zip(reqs, torch.tensor(batch.query_lens).cumsum(0).tolist()))
        last_rows = [ends[req] - 1 for req in batch.sampled]
        return self.forward(ids, positions, meta, to_device(last_rows, torch.long, self.device))

    def forward(self, ids: Tensor, positions: Tensor, meta: AttnMetadata, rows: Tensor) -> Tensor:
        if self.ranks:
            self.ranks.send("forward", ids, positions, meta, rows)
        return self.model(ids, positions, self.kv_caches, meta, rows)

    def decode(self, ids: Tensor, positions: Tensor, meta: AttnMetadata) -> Tensor:
        if self.ranks:
            self.ranks.send("decode", ids, positions, meta)
        return self.graphs.run(ids, positions, meta)

    def capture(self, max_num_seqs: int, max_model_len: int, cuda_graphs: bool) -> None:
        """Static decode buffers, CUDA graphs if asked (all ranks at once: all-reduces meet)."""
        if self.ranks:
            self.ranks.send("capture", max_num_seqs, max_model_len, cuda_graphs)
        sizes = [1, 2, 4, *range(GRAPH_BATCH_STEP, max_num_seqs, GRAPH_BATCH_STEP)]
        sizes = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, sizes, max_model_len, self.block_size, cuda_graphs
        )


@dataclass
class Batch:
    """One step's work: the scheduled requests and how many new tokens each computes; `sampled`
    are those that reach the end of their known tokens, so that a new token is sampled for them."""

    reqs: list[Request]
    query_lens: list[int]
    sampled: list[Request]

    @classmethod
    def of(cls, scheduled: list[tuple[Request, int]]) -> "Batch":
        sampled = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
        return cls([r for r, _ in scheduled], [n for _, n in scheduled], sampled)

    @property
    def num_decodes(self) -> int:
        return sum(n == 1 for n in self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens) - self.num_decodes


class DecodeGraphs:
    """Decode-only steps at padded batch sizes through static buffers: CUDA graphs on CUDA,
    the same padded forward eagerly elsewhere (docs/design.md, "CUDA graphs")."""

    def __init__(
        self,
        model: Transformer,
        kv_caches: list,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        capture: bool,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        device = kv_caches[0][0].device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.input_ids)
        self.slot_mapping = torch.full_like(self.input_ids, -1)
        self.rows = torch.arange(n, device=device)
        max_blocks = cdiv(max_model_len, block_size)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttnMetadata(
            self.slot_mapping[:size],
            self.block_tables[:size],
            self.seq_lens[:size],
            self.query_start_loc[: size + 1],
            size,
            [1] * size,
            [self.max_model_len] * size,
        )
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.rows[:size]
        )

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
            self._forward(size)  # Triton compiles outside the capture
            self.graphs[size] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[size], pool=pool):
                self.logits[size] = self._forward(size)

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttnMetadata) -> Tensor:
        """Logits of a decode-only batch: its rows first, then padding up to the next size."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:size] = -1
        self.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.seq_lens[:n] = meta.seq_lens
        self.seq_lens[n:size] = 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.logits[size][:n]
        return self._forward(size)[:n]
