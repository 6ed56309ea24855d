"""Triton attention kernels against their torch references (nanoflow/attention.py).

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with one they run compiled on
CUDA. Every case uses fresh random data, NaN-poisoned outputs and shuffled block tables.
"""

import os

import torch

# Read by triton.jit when the kernels are defined, so it must be set before nanoflow.attention imports triton.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from nanoflow import attention  # noqa: E402
from nanoflow.attention import AttnMetadata  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] != "0"
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max|a - b| / max|b|
NUM_LAYERS, LAYER = 2, 1  # the kernels see layer 1's views of a two-layer pool
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                reason="needs a CUDA device (and TRITON_INTERPRET unset or 0)")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty / empty_like hand out NaN, so an element a kernel leaves unwritten fails the comparison."""
    def poisoned(make):
        def wrapper(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapper
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


def make_batch(query_lens, seq_lens, num_decodes, block_size, kv_heads, group, head_dim, dtype, device=DEVICE):
    """Random q and KV pool, and metadata whose sequences own shuffled blocks of the pool."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    ids = torch.randperm(sum(blocks_per_seq) + 3)  # a few blocks belong to nobody
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots = []
    for i, (n, q_len, s_len) in enumerate(zip(blocks_per_seq, query_lens, seq_lens)):
        tables[i, :n] = ids[sum(blocks_per_seq[:i]):][:n]
        pos = torch.arange(s_len - q_len, s_len)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    pool = torch.randn(len(ids), NUM_LAYERS, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, dtype=dtype, device=device)
    meta = AttnMetadata(
        slot_mapping=torch.cat(slots).to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0] + query_lens, device=device).cumsum(0).to(torch.int32),
        num_decodes=num_decodes, query_lens=list(query_lens), seq_lens_list=list(seq_lens))
    return q, pool, meta


def kv_views(pool):
    return pool[:, LAYER, 0], pool[:, LAYER, 1]


def ragged_lens(block_size):
    return [1, block_size - 1, block_size, block_size + 1, 4 * block_size + 3]


@pytest.mark.parametrize("block_size,kv_heads,head_dim,dtype", [
    (16, 2, 64, torch.float32), (32, 3, 128, torch.bfloat16)])
def test_store_kv(block_size, kv_heads, head_dim, dtype, monkeypatch):
    monkeypatch.setenv("NANOFLOW_ATTN", "triton")
    query_lens = [1, block_size + 1, 3]
    _, pool, meta = make_batch(query_lens, [9, block_size + 1, 2 * block_size + 2], 0, block_size, kv_heads, 1,
                               head_dim, dtype)
    kv = torch.randn(sum(query_lens), 2, kv_heads, head_dim, dtype=dtype, device=DEVICE)  # k, v: strided views
    expected = pool.clone()
    attention.store_kv_ref(kv[:, 0], kv[:, 1], *kv_views(expected), meta.slot_mapping)
    attention.store_kv(kv[:, 0], kv[:, 1], *kv_views(pool), meta.slot_mapping)
    assert torch.equal(pool, expected)  # new slots written, every other element of the pool untouched


@pytest.mark.parametrize("block_size,group,head_dim,dtype", [
    (16, 1, 64, torch.float32), (32, 3, 128, torch.bfloat16), (16, 4, 128, torch.float32),
    (32, 7, 64, torch.bfloat16)])
def test_decode(block_size, group, head_dim, dtype, monkeypatch, nan_empty):
    monkeypatch.setattr(attention, "DECODE_MIN_SPLIT", attention.DECODE_BLOCK_N)  # several splits to merge
    seq_lens = ragged_lens(block_size)
    q, pool, meta = make_batch([1] * len(seq_lens), seq_lens, len(seq_lens), block_size, 2, group, head_dim, dtype)
    args = (q, *kv_views(pool), meta.block_tables, meta.seq_lens, max(seq_lens), head_dim ** -0.5)
    out = attention.decode_attention_triton(*args)
    assert out.dtype == dtype
    assert rel_err(out, attention.decode_attention_ref(*args)) <= TOL[dtype]


@pytest.mark.parametrize("block_size,group,head_dim,dtype", [
    (16, 1, 128, torch.bfloat16), (32, 4, 64, torch.float32), (16, 7, 64, torch.float32),
    (32, 3, 128, torch.bfloat16)])
def test_extend(block_size, group, head_dim, dtype, nan_empty):
    # (chunk length, cached prefix length): every ragged length, with and without a prefix
    chunks = [(block_size + 1, 0), (1, 2 * block_size + 5), (block_size - 1, block_size), (block_size, 3),
              (3 * block_size + 2, block_size + 1)]
    query_lens = [n for n, _ in chunks]
    q, pool, meta = make_batch(query_lens, [n + p for n, p in chunks], 0, block_size, 2, group, head_dim, dtype)
    scale = head_dim ** -0.5
    out = attention.paged_attention_triton(q, *kv_views(pool), meta, scale)
    assert out.dtype == dtype
    assert rel_err(out, attention.paged_attention_ref(q, *kv_views(pool), meta, scale)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_through_dispatchers(dtype, monkeypatch, nan_empty):
    """One layer of a mixed step (store the new K/V, then attend) with each backend, from the same pool."""
    block_size, kv_heads, group, head_dim = 16, 2, 4, 64
    decode_lens = ragged_lens(block_size)
    chunks = [(5, 0), (block_size + 1, 20)]
    query_lens = [1] * len(decode_lens) + [n for n, _ in chunks]
    seq_lens = decode_lens + [n + p for n, p in chunks]
    q, pool, meta = make_batch(query_lens, seq_lens, len(decode_lens), block_size, kv_heads, group, head_dim, dtype)
    k, v = torch.randn(2, len(q), kv_heads, head_dim, dtype=dtype, device=DEVICE)
    outs, pools = {}, {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("NANOFLOW_ATTN", backend)
        pools[backend] = pool.clone()
        attention.store_kv(k, v, *kv_views(pools[backend]), meta.slot_mapping)
        outs[backend] = attention.paged_attention(q, *kv_views(pools[backend]), meta, head_dim ** -0.5)
        monkeypatch.setattr(attention, "paged_attention_ref", None)  # the triton pass must not fall back
    assert torch.equal(pools["triton"], pools["torch"])
    assert rel_err(outs["triton"], outs["torch"]) <= TOL[dtype]


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("NANOFLOW_ATTN", raising=False)
    assert attention.attention_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("NANOFLOW_ATTN", "triton")
    assert attention.attention_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("NANOFLOW_ATTN", "cuda")
    with pytest.raises(ValueError, match="NANOFLOW_ATTN"):
        attention.attention_backend(torch.device("cpu"))


@needs_cuda
def test_cuda_llama_mixed_step(monkeypatch):
    """Llama-3-8B attention shapes, bf16, compiled: a mixed step of long decodes and extend chunks."""
    monkeypatch.delenv("NANOFLOW_ATTN", raising=False)  # CUDA picks triton by itself
    block_size, kv_heads, group, head_dim, dtype = 16, 8, 4, 128, torch.bfloat16
    decode_lens = [1, 15, 16, 17, 300, 1000, 2047, 4099]
    chunks = [(512, 0), (100, 1000), (1, 700), (77, 3)]
    query_lens = [1] * len(decode_lens) + [n for n, _ in chunks]
    seq_lens = decode_lens + [n + p for n, p in chunks]
    q, pool, meta = make_batch(query_lens, seq_lens, len(decode_lens), block_size, kv_heads, group, head_dim, dtype)
    k, v = torch.randn(2, len(q), kv_heads, head_dim, dtype=dtype, device=DEVICE)
    expected_pool = pool.clone()
    attention.store_kv_ref(k, v, *kv_views(expected_pool), meta.slot_mapping)
    attention.store_kv(k, v, *kv_views(pool), meta.slot_mapping)
    assert torch.equal(pool, expected_pool)
    scale = head_dim ** -0.5
    out = attention.paged_attention(q, *kv_views(pool), meta, scale)
    assert rel_err(out, attention.paged_attention_ref(q, *kv_views(pool), meta, scale)) <= TOL[dtype]


@needs_cuda
@pytest.mark.parametrize("batch,context", [(1, 8192), (32, 2048)])
def test_cuda_llama_decode_splits(batch, context):
    """Flash-decoding with the default split heuristic at Llama-3-8B shapes, bf16, compiled."""
    seq_lens = torch.randint(context // 2, context + 1, (batch,)).tolist()
    q, pool, meta = make_batch([1] * batch, seq_lens, batch, 16, 8, 4, 128, torch.bfloat16)
    args = (q, *kv_views(pool), meta.block_tables, meta.seq_lens, max(seq_lens), 128 ** -0.5)
    assert rel_err(attention.decode_attention_triton(*args), attention.decode_attention_ref(*args)) <= 2e-2
