"""Paged attention: the only place where a request's KV cache is read or written.

The engine hands every layer one flat batch of new tokens: first `num_decodes` sequences with one
query token each, then prefill/extend chunks of any length on top of whatever prefix is already
cached. Each sequence's KV lives in fixed-size blocks of the pool (kv.py) listed by its row of
`block_tables`; `slot_mapping` says where each new token's K/V goes. It imports no nanoflow module.

Each operation has a plain-torch reference and, beside it, a Triton kernel. The references are the
CPU path and the oracle that the kernels are tested against (on CPU through TRITON_INTERPRET=1).
The kernels take the per-layer cache views [num_blocks, block_size, kv_heads, head_dim] through
their strides: a view of the block-major pool is not contiguous, and copying it would defeat paging.
"""

# kernel annotations (tl.constexpr) stay strings when triton is absent
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

try:  # the torch path needs no triton; the Triton backend says so when it is asked for
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

# kernels use exp2: exp(x) = exp2(x * LOG2E), folded into the softmax scale
LOG2E = math.log2(math.e)
# Extend tiles (queries per program, keys per step, warps) for sm_80..sm_90 (test_all.py): shared
# memory within an RTX 4090's 99 KiB, no spills (fp32 tiles sit in registers: 32 x 32 spills).
EXTEND_TILES_FP32 = (32, 16, 4)
EXTEND_TILES_16BIT = (64, 64, 4)
EXTEND_TILES_16BIT_WIDE = (64, 32, 4)  # head_dim > 64: half the keys, or sm_80/86 spill
DECODE_BLOCK_N = 64  # keys per step of the decode loop
DEFAULT_WARPS = 4  # Triton's own default
DECODE_WARPS_FP32 = 8  # fp32 decode tiles spill on sm_80 with 4 warps (FMA dots again)
# the merge keeps all splits' outputs in registers: 64 x 128 fp32 needs 8 warps on sm_80
DECODE_MAX_SPLITS = 64
MERGE_WARPS = 8
DECODE_MIN_SPLIT = 256  # tokens: a shorter split costs more to merge than its parallelism gains
DECODE_TARGET_PROGRAMS = 512  # enough decode programs to fill a large GPU a few times over


@dataclass
class AttnMetadata:
    """Where the new tokens of one step go and what each sequence attends to."""

    # [num_tokens] int64: block_id * block_size + offset of each new token; -1: a padding row
    slot_mapping: Tensor
    block_tables: Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: Tensor  # [num_seqs] int32: KV length after this step (cached prefix + new tokens)
    query_start_loc: Tensor  # [num_seqs + 1] int32: cu_seqlens of the new tokens
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    query_lens: list[int]  # host copies, for loops and grid sizes
    seq_lens_list: list[int]


# ---------------------------------------------------------------- the entry points


def launch_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the thread's current CUDA device: make it the tensors'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    if _use_triton(k.device):
        with launch_device(k.device):
            return store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float
) -> Tensor:
    """Attention of every new token of the flat batch over its sequence's paged KV."""
    if _use_triton(q.device):
        with launch_device(q.device):
            return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def attention_backend(device: torch.device) -> str:
    """Triton on CUDA, torch elsewhere; NANOFLOW_ATTN=triton|torch forces one."""
    forced = os.environ.get("NANOFLOW_ATTN")
    if forced not in (None, "", "triton", "torch"):
        raise ValueError(f"NANOFLOW_ATTN must be 'triton' or 'torch', not {forced!r}")
    return forced or ("triton" if device.type == "cuda" else "torch")


def _use_triton(device: torch.device) -> bool:
    if attention_backend(device) != "triton":
        return False
    if triton is None:
        raise RuntimeError(
            "Triton attention needs triton: pip install triton, or set NANOFLOW_ATTN=torch"
        )
    return True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _jit(fn):
    """triton.jit when triton is installed; without it the kernels are never launched."""
    return triton.jit(fn) if triton else fn


def _interpreting() -> bool:
    """Triton's interpreter multiplies bf16 wrongly: the kernels then upcast tl.dot operands."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cache_strides(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int]:
    same_pool = k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert same_pool, "K/V caches must be views of one pool"
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


# ---------------------------------------------------------------- store KV


def store_kv_ref(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """New K/V [num_tokens, kv_heads, head_dim] into views [num_blocks, block_size, kv_heads, d]."""
    block_size = k_cache.shape[1]
    real = slot_mapping >= 0
    blocks, offsets = slot_mapping[real] // block_size, slot_mapping[real] % block_size
    k_cache[blocks, offsets] = k[real]
    v_cache[blocks, offsets] = v[real]


@_jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_t,
    stride_h,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program copies one new token's K and V (all KV heads) into its slot of the pool.
    token = tl.program_id(0)
    # int64: block offsets can pass 2**31 elements in a big pool
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # a padding row of a CUDA graph's batch
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    src = token * stride_t + h * stride_h + d
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def store_kv_triton(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    num_tokens, kv_heads, head_dim = k.shape
    same_strides = k.stride() == v.stride() and k.stride(2) == 1
    assert same_strides, "k and v must share strides, head_dim contiguous"
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        *_cache_strides(k_cache, v_cache),
        **store_kv_config(k_cache.shape[1], kv_heads, head_dim),
    )


def store_kv_config(block_size: int, kv_heads: int, head_dim: int) -> dict:
    """The store kernel's constexprs (for its launcher and for the compile tests alike)."""
    return dict(
        BLOCK_SIZE=block_size,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


# ---------------------------------------------------------------- attention: shared pieces


def _gather_context(cache: Tensor, block_tables: Tensor, max_len: int) -> Tensor:
    """[num_seqs, max_len, kv_heads, head_dim]: each sequence's first max_len cached tokens."""
    block_size = cache.shape[1]
    num_blocks = cdiv(max_len, block_size)
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    gathered = torch.index_select(cache, 0, ids)  # much faster on CPU than advanced indexing
    seqs = gathered.view(block_tables.shape[0], num_blocks * block_size, *cache.shape[2:])
    return seqs[:, :max_len]


@_jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    pos,
    in_range,
    kv_head,
    d,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V [len(pos), len(d)] of one KV head at token positions pos (0 outside in_range)."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    offsets = (
        block[:, None] * stride_cb
        + (pos % BLOCK_SIZE)[:, None] * stride_cs
        + kv_head * stride_ch
        + d[None, :]
    )
    mask = in_range[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    return k, tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)


@_jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32 (IEEE fp32 products for fp32 operands, not TF32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@_jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    """Fold one tile of keys/values [BLOCK_N, BLOCK_D] into each query row's running max, sum and
    output. Every row must have an allowed key in its first tile, so that m_i stays finite."""
    s = tl.where(allowed, _dot(q, tl.trans(k), UPCAST) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


# ---------------------------------------------------------------- decode attention


def decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    max_seq_len: int,
    scale: float,
) -> Tensor:
    """One query token per sequence: q [num_seqs, heads, d] -> [num_seqs, heads, d].
    Two bmm's per KV head, scores in fp32: on a CPU 3-5x faster than SDPA's flash kernel,
    which tiles for many queries (docs/results.md)."""
    k = _gather_context(k_cache, block_tables, max_seq_len)
    v = _gather_context(v_cache, block_tables, max_seq_len)
    num_seqs, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # one contiguous [len, d] matrix per (sequence, KV head): the layout bmm runs fastest
    keys = k.transpose(1, 2).reshape(-1, max_seq_len, head_dim).float()
    values = v.transpose(1, 2).reshape(-1, max_seq_len, head_dim)
    queries = q.reshape(-1, group, head_dim).float()
    scores = torch.bmm(queries, keys.transpose(1, 2)) * scale  # [seqs * kv_heads, group, len]
    past_end = torch.arange(max_seq_len, device=q.device) >= seq_lens[:, None]
    scores.masked_fill_(past_end.repeat_interleave(kv_heads, dim=0)[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(probs, values).view(num_seqs, heads, head_dim)


@_jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    split_len,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program: the GROUP query heads sharing KV head `kv_head` of decode sequence `seq`,
    # over context tokens [split * split_len, (split + 1) * split_len). Writes their normalized
    # partial outputs and log2-sum-exp2 for the merge; rows past GROUP pad it to tl.dot's 16.
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    if start >= seq_len:
        return  # the merge skips splits past the end
    end = tl.minimum(start + split_len, seq_len)
    g = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_range = pos < end
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            pos,
            in_range,
            kv_head,
            d,
            stride_cb,
            stride_cs,
            stride_ch,
            HEAD_DIM,
            BLOCK_SIZE,
        )
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, in_range[None, :], m_i, l_i, acc, qk_scale, UPCAST
        )
    # [seq, head, split]
    part = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g < GROUP)
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=q_mask)


@_jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    split_len,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: one head of one decode sequence, its splits weighted by exp2(lse - max lse)
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    valid = s < tl.cdiv(tl.load(seq_lens_ptr + seq), split_len)
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=valid[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * o, 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def decode_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    max_seq_len: int,
    scale: float,
) -> Tensor:
    """Flash-decoding: attend over splits of each context in parallel, then merge them."""
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    # split long contexts until the grid has DECODE_TARGET_PROGRAMS programs
    num_splits = min(
        cdiv(max_seq_len, DECODE_MIN_SPLIT),
        cdiv(DECODE_TARGET_PROGRAMS, num_seqs * kv_heads),
        DECODE_MAX_SPLITS,
    )
    split_len = cdiv(cdiv(max_seq_len, num_splits), DECODE_BLOCK_N) * DECODE_BLOCK_N
    num_splits = cdiv(max_seq_len, split_len)
    part_out = q.new_empty(num_seqs, heads, num_splits, head_dim, dtype=torch.float32)
    part_lse = q.new_empty(num_seqs, heads, num_splits, dtype=torch.float32)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        split_len,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        *_cache_strides(k_cache, v_cache),
        **decode_config(heads // kv_heads, head_dim, k_cache.shape[1], q.dtype),
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(num_seqs, heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        split_len,
        num_splits,
        out.stride(0),
        out.stride(1),
        **merge_config(head_dim, num_splits),
    )
    return out


def decode_config(group: int, head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_BLOCK_N,
        BLOCK_D=triton.next_power_of_2(head_dim),
        UPCAST=_interpreting(),
        num_warps=DECODE_WARPS_FP32 if dtype == torch.float32 else DEFAULT_WARPS,
    )


def merge_config(head_dim: int, num_splits: int) -> dict:
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=MERGE_WARPS,
    )


# ---------------------------------------------------------------- prefill / extend attention


def extend_attention_ref(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float, out: Tensor
) -> None:
    """Chunks after the decodes, into out: each attends causally to its prefix and itself."""
    start = meta.num_decodes
    for i in range(meta.num_decodes, len(meta.query_lens)):
        n = meta.query_lens[i]
        seq_len = meta.seq_lens_list[i]
        k = _gather_context(k_cache, meta.block_tables[i][None], seq_len)
        v = _gather_context(v_cache, meta.block_tables[i][None], seq_len)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None] <= q_pos[:, None]
        queries = q[start : start + n].transpose(0, 1)  # [heads, n, d]
        keys = k[0].transpose(0, 1)  # [kv_heads, seq_len, d]
        values = v[0].transpose(0, 1)
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # fused, in the pool's dtype (it sums in fp32)
        out[start : start + n] = attended.transpose(0, 1)
        start += n


@_jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    first_seq,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program: query tokens [m_block * BLOCK_M, (m_block + 1) * BLOCK_M) of one chunk, one
    # head, causal over the cached prefix and the chunk (both read through the block table).
    m_block, head, seq = tl.program_id(0), tl.program_id(1), first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # this chunk is shorter than the longest one
    seq_len = tl.load(seq_lens_ptr + seq)
    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = seq_len - q_len + m  # position of each query token in its sequence
    d = tl.arange(0, BLOCK_D)
    q_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    kv_head = head // GROUP
    table_ptr = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    past_last_query = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)
    for n0 in range(0, past_last_query, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_range = pos < past_last_query
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            table_ptr,
            pos,
            in_range,
            kv_head,
            d,
            stride_cb,
            stride_cs,
            stride_ch,
            HEAD_DIM,
            BLOCK_SIZE,
        )
        causal = pos[None, :] <= q_pos[:, None]  # implies pos < seq_len for real query rows
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, qk_scale, UPCAST)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + m)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def extend_attention_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float, out: Tensor
) -> None:
    """extend_attention_ref's contract, every chunk in one launch."""
    heads, head_dim = q.shape[1:]
    nd = meta.num_decodes
    config = extend_config(heads // k_cache.shape[2], head_dim, k_cache.shape[1], q.dtype)
    num_m_blocks = cdiv(max(meta.query_lens[nd:]), config["BLOCK_M"])
    grid = (num_m_blocks, heads, len(meta.query_lens) - nd)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        nd,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        *_cache_strides(k_cache, v_cache),
        **config,
    )


def extend_config(group: int, head_dim: int, block_size: int, dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        block_m, block_n, num_warps = EXTEND_TILES_FP32
    else:
        wide = head_dim > 64
        block_m, block_n, num_warps = EXTEND_TILES_16BIT_WIDE if wide else EXTEND_TILES_16BIT
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        UPCAST=_interpreting(),
        num_warps=num_warps,
    )


# ---------------------------------------------------------------- the whole batch


def _whole_batch(decode, extend):
    """paged_attention over the flat batch: the decodes in one call, then prefill chunks."""

    def attend(
        q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMetadata, scale: float
    ) -> Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = decode(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                max(meta.seq_lens_list[:nd]),
                scale,
            )
        if len(meta.query_lens) > nd:
            extend(q, k_cache, v_cache, meta, scale, out)
        return out

    return attend


paged_attention_ref = _whole_batch(decode_attention_ref, extend_attention_ref)
paged_attention_triton = _whole_batch(decode_attention_triton, extend_attention_triton)
