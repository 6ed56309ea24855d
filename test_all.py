"""nanoflow's test suite. Runs on a 2-core CPU without a GPU; CUDA-only tests are marked and skipped.

Oracles: HuggingFace transformers for the model and tokenizer, the torch references for the Triton
kernels, an uninterrupted run for anything that batches, chunks or preempts.
"""

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

# Read by triton.jit when the kernels are defined, so it must be set before nanoflow imports triton:
# kernels run in Triton's interpreter on CPU tensors without a GPU, compiled on CUDA with one.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from nanoflow import LLM, SamplingParams, attention  # noqa: E402
from nanoflow.attention import AttnMetadata  # noqa: E402
from nanoflow.model import IncrementalDetokenizer, demo_checkpoint  # noqa: E402
from nanoflow.serve import MAX_BODY_BYTES, make_server, parse_args  # noqa: E402

# ---------------------------------------------------------------- fixtures: small random checkpoints

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(path, vocab_size: int) -> None:
    """A byte-level BPE trained on a few sentences, with the chat control tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, once upon a time"] * 8,
                           trainer)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))


def write_checkpoint(path, arch: str, seed: int = 0, **overrides):
    """Random weights saved with transformers' save_pretrained; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        cfg = LlamaConfig(**{**TINY, **overrides}, rope_scaling=rope, rope_theta=500000.0, eos_token_id=2)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**{**TINY, **overrides}, tie_word_embeddings=True, eos_token_id=2)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random biases, so that a dropped bias shows
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval().save_pretrained(path, max_shard_size="100KB" if arch == "llama" else "1GB")
    write_tokenizer(path, cfg.vocab_size)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_checkpoint(path, request.param)


def random_prompts(n: int, vocab: int, seed: int = 0, lengths=(1, 200)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

# ---------------------------------------------------------------- model against transformers


def engine_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, computed by nanoflow's forward in one prefill."""
    from nanoflow.kv import build_metadata

    eng = llm.engine
    table: list[int] = []
    assert eng.kv.grow(table, len(prompt))
    meta, positions = build_metadata([table], [0], [len(prompt)], 0, eng.kv.block_size, eng.device)
    logits = eng.model(torch.tensor(prompt), positions, eng.kv_caches, meta, torch.arange(len(prompt)))
    eng.kv.free(table)
    return logits


def test_logits_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    for prompt in random_prompts(4, TINY["vocab_size"], seed=1):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert (engine_logits(llm, prompt) - expected).abs().max() <= 1e-4


def test_greedy_matches_transformers_generate(tiny):
    path, hf = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    prompts = random_prompts(3, TINY["vocab_size"], seed=2, lengths=(5, 60))
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"


# ---------------------------------------------------------------- the engine: batching, chunking, preemption


def test_continuous_batching_matches_one_by_one(tiny):
    path, _ = tiny
    prompts = random_prompts(16, TINY["vocab_size"], seed=3, lengths=(1, 120))
    alone = LLM(path, device="cpu", num_kv_blocks=64)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    # a small token budget forces chunked prefill mixed with decodes; staggered max_tokens make
    # requests leave (and others keep running) at different steps
    batched = LLM(path, device="cpu", num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=6)
    params = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(16)]
    outs = batched.generate(prompts, params)
    assert [o.token_ids for o in outs] == [e[:8 + i] for i, e in enumerate(expected)]


@pytest.mark.parametrize("policy", ["fcfs", "tokenflow"])
def test_small_pool_preempts_and_frees_everything(tiny, policy):
    path, _ = tiny
    prompts = random_prompts(8, TINY["vocab_size"], seed=4, lengths=(20, 60))
    expected = [o.token_ids for o in LLM(path, device="cpu", num_kv_blocks=128).generate(prompts, GREEDY)]
    small = LLM(path, device="cpu", num_kv_blocks=12, policy=policy)  # 192 slots; the 8 requests need ~600
    reqs_seen = []
    real_step = small.engine.step

    def step():
        reqs_seen.extend(small.engine.scheduler.running)
        kv = small.engine.kv
        held = [b for r in small.engine.scheduler.running for b in r.block_table]
        assert len(held) == len(set(held)) == kv.num_used and kv.num_free + kv.num_used == kv.num_blocks
        return real_step()

    small.engine.step = step
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert any(r.num_preemptions for r in reqs_seen)
    assert small.engine.kv.num_free == small.engine.kv.num_blocks


# ---------------------------------------------------------------- errors


def test_errors_name_the_problem(tmp_path, tiny):
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=8)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 600], GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=100))
    for bad, field in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                       (dict(top_p=0), "top_p"), (dict(top_k=0), "top_k"), (dict(stop=[""]), "stop"),
                       (dict(seed="x"), "seed")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    # a broken checkpoint: wrong architecture, then a missing tensor
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        LLM(bad, device="cpu", num_kv_blocks=8)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="model.layers.2"):
        LLM(bad, device="cpu", num_kv_blocks=8)


# ---------------------------------------------------------------- sampling and stopping


def clean_text_prompt(llm: LLM) -> list[int]:
    """A random prompt whose greedy continuation decodes to whole characters (random models often emit stray bytes)."""
    for seed in range(100):
        prompt = random_prompts(1, TINY["vocab_size"], seed=seed)[0]
        text = llm.generate([prompt], GREEDY)[0].text
        if len(text) > 10 and "\ufffd" not in text:
            return prompt
    raise AssertionError("no prompt with a clean continuation")


def test_sampling_seeded_topk_and_stops(tiny):
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    prompt = clean_text_prompt(llm)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], sampled)
    assert a.token_ids == b.token_ids  # same seed, same tokens, even when batched together
    c = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=8, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids
    greedy = llm.generate([prompt], GREEDY)[0]
    top1 = llm.generate([prompt], SamplingParams(temperature=0.7, top_k=1, max_tokens=32, seed=1, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids
    # a stop string cuts the text before it; max_tokens gives "length"
    stop = greedy.text[5:8]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == greedy.text[:greedy.text.find(stop)]


def test_eos_stops_unless_ignored(tiny):
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    prompt = random_prompts(1, TINY["vocab_size"], seed=6)[0]
    free_run = llm.generate([prompt], GREEDY)[0].token_ids
    llm.tokenizer.eos_token_ids = [free_run[3]]  # pretend the 4th token is EOS
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert stopped.token_ids == free_run[:free_run.index(free_run[3]) + 1] and stopped.finish_reason == "stop"
    assert llm.generate([prompt], GREEDY)[0].token_ids == free_run


# ---------------------------------------------------------------- tokenizer, detokenizer, chat template


def test_incremental_detokenizer_never_splits_characters(tiny):
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=8)
    tok = llm.tokenizer
    text = "héllo wörld 😀 naïve café 日本語 🎉!"
    ids = tok.encode(text)
    detok, pieces = IncrementalDetokenizer(tok), []
    for i in range(1, len(ids) + 1):
        piece = detok.step(ids[:i])
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok.flush(ids))
    assert "".join(pieces) == tok.decode(ids) == text


def test_chat_template_is_applied(tiny):
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=64)
    conv = [{"role": "user", "content": "hello world"}]
    ids = llm.tokenizer.apply_chat_template(conv)
    assert llm.tokenizer.tk.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert llm.chat(conv, GREEDY)[0].token_ids == llm.generate([ids], GREEDY)[0].token_ids


# ---------------------------------------------------------------- the demo model (SmolLM2-135M-Instruct GGUF)


@pytest.fixture(scope="module")
def demo():
    return LLM(device="cpu", num_kv_blocks=128)


@pytest.fixture(scope="module")
def demo_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_checkpoint()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


def test_demo_model_knows_paris(demo):
    out = demo.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.text


def test_demo_model_matches_transformers(demo, demo_hf):
    tok, model = demo_hf
    ids = tok("Once upon a time")["input_ids"]
    assert ids == demo.tokenizer.encode("Once upon a time")
    ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert demo.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids == ref


@pytest.mark.parametrize("text", ["1234567 + 89 = 1234656", "  two  spaces\n\n\ttab   end ", "<|im_start|>user\nhi<|im_end|>",
                                  "café naïve Ærøskøbing", "emoji 😀🎉 and 日本語", "don't I'll we're"])
def test_gguf_tokenizer_matches_transformers(demo, demo_hf, text):
    tok, _ = demo_hf
    assert demo.tokenizer.encode(text) == tok(text)["input_ids"]
    assert demo.tokenizer.decode(tok(text)["input_ids"]) == tok.decode(tok(text)["input_ids"], skip_special_tokens=True)


def test_demo_chat_stops_at_end_of_turn(demo):
    out = demo.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and "Paris" in out.text and "<|im_end|>" not in out.text


# ---------------------------------------------------------------- Triton kernels against their torch references

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
    return [1, block_size - 1, block_size, block_size + 1, 8 * block_size + 3]


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


def test_decode_default_splits(nan_empty):
    """The launcher's own split choice: a context past DECODE_MIN_SPLIT beside one that fits in a split."""
    seq_lens = [2 * attention.DECODE_MIN_SPLIT + 7, 5]
    q, pool, meta = make_batch([1, 1], seq_lens, 2, 16, 1, 2, 64, torch.float32)
    args = (q, *kv_views(pool), meta.block_tables, meta.seq_lens, max(seq_lens), 64 ** -0.5)
    assert rel_err(attention.decode_attention_triton(*args), attention.decode_attention_ref(*args)) <= 1e-5


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


@pytest.mark.cuda
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


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("batch,context", [(1, 8192), (32, 2048)])
def test_cuda_llama_decode_splits(batch, context):
    """Flash-decoding with the default split heuristic at Llama-3-8B shapes, bf16, compiled."""
    seq_lens = torch.randint(context // 2, context + 1, (batch,)).tolist()
    q, pool, meta = make_batch([1] * batch, seq_lens, batch, 16, 8, 4, 128, torch.bfloat16)
    args = (q, *kv_views(pool), meta.block_tables, meta.seq_lens, max(seq_lens), 128 ** -0.5)
    assert rel_err(attention.decode_attention_triton(*args), attention.decode_attention_ref(*args)) <= 2e-2


def test_triton_engine_matches_torch(tiny, monkeypatch):
    """End to end: the same greedy tokens with either backend, continuous batching and chunked prefill in play."""
    path, _ = tiny
    prompts = random_prompts(4, TINY["vocab_size"], seed=9, lengths=(1, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("NANOFLOW_ATTN", backend)
        llm = LLM(path, device=DEVICE, num_kv_blocks=32, max_num_batched_tokens=24)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


# ---------------------------------------------------------------- swap: host KV pool, write-through, evict/load


def check_pools(engine) -> None:
    """Accounting never lies: free + used == total in both pools, and no block has two owners."""
    s = engine.scheduler
    reqs = s.running + list(s.waiting)
    for pool, tables in [(engine.kv, [r.block_table for r in reqs]), (s.swapper.host, [r.host_block_table for r in reqs])]:
        held = [b for t in tables for b in t] + [b for _, blocks in pool.pending_free for b in blocks]
        assert len(held) == len(set(held)), "a block has two owners"
        assert pool.num_free + len(held) == pool.num_blocks == pool.num_free + pool.num_used


def run_checked(llm: LLM, prompts, params):
    """generate(), checking the pools after every step and noting where requests were preempted.

    Besides the scheduler's forced preemptions, each request is preempted once right after its
    KV crossed into a new block."""
    engine, points, crossed = llm.engine, [], set()
    real_step, real_preempt = engine.step, engine.scheduler.preempt

    def step():
        for req in list(engine.scheduler.running):
            if req.num_computed_tokens > 16 and req.num_computed_tokens % 16 == 1 and req not in crossed:
                crossed.add(req)
                engine.scheduler.preempt(req)
        out = real_step()
        check_pools(engine)
        return out

    def preempt(req):
        points.append((req.num_computed_tokens, len(req.prompt_token_ids)))
        real_preempt(req)

    engine.step, engine.scheduler.preempt = step, preempt
    outs = llm.generate(prompts, params)
    engine.scheduler.swapper.complete_all()
    assert engine.kv.num_free == engine.kv.num_blocks
    assert engine.scheduler.swapper.host.num_free == engine.scheduler.swapper.host.num_blocks
    return [o.token_ids for o in outs], points


@pytest.mark.parametrize("resume", ["load", "recompute"])
def test_forced_preemption_gives_identical_tokens(tiny, resume):
    path, _ = tiny
    prompts = random_prompts(6, TINY["vocab_size"], seed=10, lengths=(10, 70))
    expected = [o.token_ids for o in LLM(path, device="cpu", num_kv_blocks=64).generate(prompts, GREEDY)]
    llm = LLM(path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=24, host_kv_gb=0.01, policy="fcfs")
    llm.engine.scheduler.force_preempt_every, llm.engine.scheduler.force_resume = 3, resume
    tokens, points = run_checked(llm, prompts, GREEDY)
    assert tokens == expected
    stats = llm.stats()
    assert stats[f"resumes_{resume}"] >= 2 * len(prompts) and stats["preemptions"] == len(points)
    assert stats[f"resumes_{'recompute' if resume == 'load' else 'load'}"] == 0
    assert any(0 < done < prompt for done, prompt in points), "no preemption mid-prefill"
    assert any(done > 16 and done % 16 in (0, 1) for done, _ in points), "none right after a block boundary"
    if resume == "load":
        assert stats["blocks_written_through"] > 0 and stats["bytes_to_host"] > 0 and stats["bytes_to_device"] > 0


def test_host_pool_too_small_falls_back_to_recompute(tiny):
    path, _ = tiny
    prompts = random_prompts(4, TINY["vocab_size"], seed=11, lengths=(30, 60))
    expected = [o.token_ids for o in LLM(path, device="cpu", num_kv_blocks=64).generate(prompts, GREEDY)]
    one_block = 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 16 * 4
    llm = LLM(path, device="cpu", num_kv_blocks=64, host_kv_gb=3 * one_block / (1 << 30), policy="fcfs")  # 3 host blocks
    llm.engine.scheduler.force_preempt_every, llm.engine.scheduler.force_resume = 3, "load"
    tokens, _ = run_checked(llm, prompts, GREEDY)
    assert tokens == expected
    assert llm.stats()["resumes_recompute"] > 0


def test_abort_while_preempted_or_loading_frees_everything(tiny):
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=64, host_kv_gb=0.01, policy="fcfs")
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in random_prompts(3, TINY["vocab_size"], seed=12, lengths=(40, 60))]
    for _ in range(4):
        engine.step()
    engine.scheduler.force_resume = "load"
    engine.scheduler.preempt(reqs[0])  # evicted: its KV sits in the host pool
    assert reqs[0].host_block_table and not reqs[0].block_table
    engine.abort(reqs[0].request_id)
    engine.step()  # reqs[1] and reqs[2] go on; now preempt one and abort it right after its load
    engine.scheduler.preempt(reqs[1])
    engine.scheduler._admit({}, 64, engine.clock())
    assert reqs[1].block_table and reqs[1].num_computed_tokens == reqs[1].num_host_tokens
    engine.abort(reqs[1].request_id)
    engine.abort(reqs[2].request_id)
    engine.scheduler.swapper.complete_all()
    check_pools(engine)
    assert engine.kv.num_free == engine.kv.num_blocks and engine.scheduler.swapper.host.num_free == engine.scheduler.swapper.host.num_blocks
    assert [r.finish_reason for r in reqs] == ["abort"] * 3


@pytest.mark.cuda
@needs_cuda
def test_cuda_transfers_use_a_side_stream_and_pinned_memory(tiny):
    path, _ = tiny
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=64, host_kv_gb=0.01, policy="fcfs")
    swapper = llm.engine.scheduler.swapper
    assert swapper.host.kv_cache.is_pinned() and all(h.is_pinned() for _, h in swapper.staging)
    assert swapper.stream != torch.cuda.current_stream()
    prompts = random_prompts(4, TINY["vocab_size"], seed=13, lengths=(20, 60))
    expected = [o.token_ids for o in LLM(path, device="cuda", dtype="float32", num_kv_blocks=64).generate(prompts, GREEDY)]
    llm.engine.scheduler.force_preempt_every, llm.engine.scheduler.force_resume = 2, "load"
    tokens, _ = run_checked(llm, prompts, GREEDY)
    assert tokens == expected and llm.stats()["resumes_load"] > 0


# ---------------------------------------------------------------- the HTTP server, over real sockets on 127.0.0.1
# The server runs in-process on an ephemeral port; the engine is slowed or held where a test needs
# tokens to take time (a sleep or a gate around `engine.step`). The only time bound asserted is the
# issue's: a client that leaves is aborted, and its blocks freed, within a second.

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def server(ckpt):
    srv = make_server(LLM(ckpt, device="cpu", num_kv_blocks=128), "127.0.0.1", 0, model="tiny").start()
    yield srv
    srv.shutdown()


@pytest.fixture
def gate(server, monkeypatch):
    """Holds every engine step until the test sets it (and always at the end of the test)."""
    event, step = threading.Event(), server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (event.wait(), step())[1])
    yield event
    event.set()


def slow_steps(server, monkeypatch, delay: float) -> None:
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(delay), step())[1])


def connect(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(*server.server_address[:2], timeout=30)


def call(server, method: str, path: str, body=None, headers: dict | None = None):
    """(status, response, parsed JSON or text) of one request on a fresh connection."""
    conn = connect(server)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, headers or {})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    is_json = resp.getheader("Content-Type", "").startswith("application/json")
    return resp.status, resp, json.loads(raw) if is_json else raw.decode()


def open_stream(server, path: str, body: dict) -> tuple[socket.socket, http.client.HTTPResponse]:
    """The socket (the response takes it over from its connection) and the response, headers read."""
    conn = connect(server)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    sock, resp = conn.sock, conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    return sock, resp


def hang_up(sock: socket.socket, resp: http.client.HTTPResponse) -> None:
    """Leave mid-stream, as a client that closes its tab."""
    sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    sock.close()


def sse(resp):
    """(arrival time, chunk) for each `data:` event as it arrives; the chunk of the last is "[DONE]"."""
    while line := resp.readline():
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            yield time.monotonic(), "[DONE]" if data == b"[DONE]" else json.loads(data)


def scrape(server) -> dict[str, float]:
    status, _, text = call(server, "GET", "/metrics")
    assert status == 200
    return {k: float(v) for line in text.splitlines() if line and not line.startswith("#")
            for k, v in [line.rsplit(" ", 1)]}


def wait_for(predicate, timeout: float) -> float:
    """Seconds until predicate() held; fails after timeout."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def all_free(server) -> bool:
    m = scrape(server)
    return (m["nanoflow_running"] == m["nanoflow_waiting"] == m["nanoflow_queued_requests"] == 0
            and m["nanoflow_device_blocks_free"] == m["nanoflow_device_blocks_total"])


# ---------------------------------------------------------------- streaming


def test_stream_arrives_token_by_token_and_matches_the_whole_answer(server, monkeypatch):
    delay = 0.02
    slow_steps(server, monkeypatch, delay)
    body = dict(messages=HELLO, max_tokens=24, seed=3, temperature=1.0, ignore_eos=True,
                stream_options={"include_usage": True})
    _, resp = open_stream(server, CHAT, body)
    events = list(sse(resp))
    chunks = [c for _, c in events[:-1]]
    assert events[-1][1] == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    content = [(t, c["choices"][0]["delta"]["content"]) for t, c in events[1:-3]]
    assert len(content) >= 6 and all(text for _, text in content)  # a token that ends mid-character waits
    # each chunk leaves when its token is generated: the first long before the last (24 steps of >= 20 ms),
    # and (scheduling jitter aside) a step's time apart
    times = [t for t, _ in content]
    assert times[-1] - times[0] > 10 * delay
    assert sum(b - a > delay / 2 for a, b in zip(times, times[1:])) >= len(times) // 2

    status, _, whole = call(server, "POST", CHAT, {k: v for k, v in body.items() if k != "stream_options"})
    assert status == 200 and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == "".join(text for _, text in content)
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": usage["usage"]["prompt_tokens"], "completion_tokens": 24,
                              "total_tokens": usage["usage"]["total_tokens"]}


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    extra = {"read_rate": 20.0, "ignore_eos": True}
    args = dict(model="tiny", max_tokens=12, seed=11, temperature=0.9, extra_body=extra)
    chat = client.chat.completions.create(messages=HELLO, **args)
    chunks = list(client.chat.completions.create(messages=HELLO, stream=True, stream_options={"include_usage": True},
                                                 **args))
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 12
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    done = client.completions.create(prompt="once upon a time", **args)
    pieces = list(client.completions.create(prompt="once upon a time", stream=True, **args))
    assert done.object == "text_completion" and done.usage.completion_tokens == 12
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
    stop = done.choices[0].text[5:8]  # the text is random; a stop string cuts it before its first match
    cut = client.completions.create(prompt="once upon a time", stop=stop, **args)
    cut_pieces = list(client.completions.create(prompt="once upon a time", stop=[stop], stream=True, **args))
    assert cut.choices[0].text == done.choices[0].text[:done.choices[0].text.find(stop)]
    assert "".join(p.choices[0].text for p in cut_pieces) == cut.choices[0].text
    assert cut.choices[0].finish_reason == cut_pieces[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="`n`"):
        client.chat.completions.create(messages=HELLO, n=2, **args)


def test_32_concurrent_streams(server):
    def one(i: int) -> tuple[str, int, str]:
        prompt = f"once upon a time {i}" if i % 2 else [5 + i, 17, 42 + i]  # text: tokenized on 16 threads at once
        _, resp = open_stream(server, "/v1/completions", dict(prompt=prompt, max_tokens=16, seed=i, ignore_eos=True,
                                                              stream_options={"include_usage": True}))
        chunks = [c for _, c in sse(resp)]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-2]]
        return reasons[-1], chunks[-2]["usage"]["completion_tokens"], chunks[-1]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [("length", 16, "[DONE]")] * 32
    assert all_free(server)


# ---------------------------------------------------------------- bad input, disconnects, overload, keys


BAD = [  # (method, path, body, status, error code or None)
    ("POST", CHAT, b"{not json", 400, None),
    ("POST", CHAT, b"[1, 2]", 400, None),
    ("POST", CHAT, b"[" * 100_000, 400, None),
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', 400, None),
    ("POST", CHAT, {}, 400, None),
    ("POST", CHAT, {"messages": "hi"}, 400, None),
    ("POST", CHAT, {"messages": []}, 400, None),
    ("POST", CHAT, {"messages": [{"role": "user"}]}, 400, None),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("POST", CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
    ("POST", CHAT, {"messages": HELLO, "stream": "yes"}, 400, None),
    ("POST", CHAT, {"messages": HELLO, "stream": True, "stream_options": 1}, 400, None),
    ("POST", "/v1/completions", {}, 400, None),
    ("POST", "/v1/completions", {"prompt": ""}, 400, None),
    ("POST", "/v1/completions", {"prompt": []}, 400, None),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, None),
    ("POST", "/v1/completions", {"prompt": [1, "a"]}, 400, None),
    ("POST", "/v1/completions", {"prompt": [10 ** 6]}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6}, 400, "context_length_exceeded"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "seed": 10 ** 30}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": 5}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "read_rate": 0}, 400, None),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 3}, 400, "unsupported_parameter"),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 2}, 400, "unsupported_parameter"),
    ("POST", "/v1/completions", b" " * (MAX_BODY_BYTES + 1), 413, None),
    ("GET", "/nope", None, 404, "not_found"),
    ("POST", "/v1/nope", {"prompt": "hi"}, 404, "not_found"),
    ("GET", CHAT, None, 405, "method_not_allowed"),
    ("DELETE", "/v1/models", None, 405, "method_not_allowed"),
]


def test_bad_input_gets_json_errors_and_the_server_carries_on(server):
    for method, path, body, status, code in BAD:
        got, resp, err = call(server, method, path, body, {"Content-Type": "application/json"})
        assert got == status, (method, path, body[:40] if isinstance(body, bytes) else body, err)
        assert set(err["error"]) == {"message", "type", "code"} and err["error"]["message"]
        assert code is None or err["error"]["code"] == code, err
    got, _, err = call(server, "POST", CHAT, b"{}", {"Content-Length": "abc"})
    assert got == 400 and "Content-Length" in err["error"]["message"]
    status, _, ok = call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert status == 200 and ok["usage"]["completion_tokens"] <= 4
    assert all_free(server)


def test_disconnect_aborts_the_request_within_a_step(server, monkeypatch):
    slow_steps(server, monkeypatch, 0.02)
    aborted = scrape(server).get('nanoflow_requests_total{outcome="abort"}', 0)
    sock, resp = open_stream(server, CHAT, dict(messages=HELLO, max_tokens=400, ignore_eos=True))
    events = sse(resp)
    for _ in range(4):
        next(events)
    assert scrape(server)["nanoflow_running"] == 1
    hang_up(sock, resp)
    wait_for(lambda: all_free(server), timeout=1.0)
    assert scrape(server)['nanoflow_requests_total{outcome="abort"}'] == aborted + 1


def test_client_leaving_while_queued_is_aborted(server, gate, monkeypatch):
    asked, abort = [], server.loop.abort
    monkeypatch.setattr(server.loop, "abort", lambda request_id: (asked.append(request_id), abort(request_id)))
    before = scrape(server)
    sock, resp = open_stream(server, CHAT, dict(messages=HELLO, max_tokens=400, ignore_eos=True))
    _, role_chunk = next(sse(resp))  # the request is in the engine's hands, which are held
    hang_up(sock, resp)
    wait_for(lambda: role_chunk["id"] in asked, timeout=1.0)  # the connection noticed and asked for an abort
    gate.set()
    wait_for(lambda: all_free(server), timeout=1.0)
    after = scrape(server)
    aborted = 'nanoflow_requests_total{outcome="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1
    generated = 'nanoflow_tokens_total{kind="generation"}'
    assert after[generated] - before[generated] <= 1  # at most the step that was already under way


def test_overload_gets_503_with_retry_after(server, gate, monkeypatch):
    monkeypatch.setattr(server.loop, "max_waiting", 2)
    streams = [open_stream(server, "/v1/completions", dict(prompt="hello", max_tokens=3)) for _ in range(2)]
    status, resp, err = call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert status == 503 and resp.getheader("Retry-After") == "1" and err["error"]["code"] == "overloaded"
    gate.set()
    for _, resp in streams:  # read to the end: the server closes
        assert [c for _, c in sse(resp)][-1] == "[DONE]"
    assert call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3})[0] == 200
    assert all_free(server)


def test_an_engine_failure_fails_its_requests_not_the_server(server, monkeypatch):
    step = server.engine.step

    def broken():
        monkeypatch.setattr(server.engine, "step", step)
        raise RuntimeError("injected")

    monkeypatch.setattr(server.engine, "step", broken)
    status, _, err = call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert status == 500 and err["error"]["type"] == "server_error"
    assert call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3})[0] == 200
    assert all_free(server)


def test_api_key(server, monkeypatch):
    monkeypatch.setattr(server, "api_key", "sekrit")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        status, _, err = call(server, "GET", "/v1/models", headers=headers)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
    assert call(server, "POST", CHAT, {"messages": HELLO}, {})[0] == 401
    assert call(server, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"})[0] == 200
    assert call(server, "GET", "/health")[0] == 200  # probes need no key


# ---------------------------------------------------------------- the command line


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--ckpt", "--host", "--port", "--policy", "--device", "--dtype", "--num-kv-blocks", "--host-kv-gb",
                 "--read-rate", "--api-key", "--max-waiting"):
        assert flag in text


def test_sigterm_ends_streams_and_exits_0(ckpt):
    proc = subprocess.Popen([sys.executable, "-m", "nanoflow.serve", "--ckpt", str(ckpt), "--port", "0",
                             "--device", "cpu", "--num-kv-blocks", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    try:
        line = proc.stdout.readline()
        assert "serving tiny-llama" in line, proc.stderr.read()
        host, port = line.split("http://")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(dict(prompt="hello", max_tokens=400, ignore_eos=True,
                                                                stream=True)))
        events = sse(conn.getresponse())
        next(events)
        proc.send_signal(signal.SIGTERM)
        assert [c for _, c in events][-1] == "[DONE]"
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()


# ---------------------------------------------------------------- readers, metrics, the tokenflow policy, the simulator

from nanoflow.metrics import (Reader, RequestRecord, effective_weights, qoe, read_times,  # noqa: E402
                              rebuffer_time, summarize)
from nanoflow.sched import TokenFlowConfig  # noqa: E402
from nanoflow.sim import SMOLLM2_135M, CostModel, build_engine  # noqa: E402


def test_metrics_by_hand():
    times = [1.0, 1.1, 1.2, 2.0]  # a request that arrived at 0; its reader reads 10 tokens/s
    assert read_times(times, 10.0) == pytest.approx([1.0, 1.1, 1.2, 2.0])
    assert rebuffer_time(times, 10.0) == pytest.approx(0.7)  # the 4th token was due at 1.3, came at 2.0
    assert qoe(0.0, times, 10.0) == pytest.approx(1 - 0.4 / 5.3)  # late only the 4th: 2.0 vs ideal 1.3 + 0.3
    reader = Reader(10.0)
    assert reader.buffer(times[:3], 1.15) == 1 and reader.buffer(times, 2.5) == 0
    # L = 20 tokens all generated at once, read at 1 token/s: token j finds j - 1 tokens unread
    weights = effective_weights([0.001 * j for j in range(20)], 1.0, 20)
    assert (weights[2], weights[4], weights[6]) == (1.0, pytest.approx(0.5), 0.0)  # buffer 5%, 15%, 25% of L
    s = summarize([RequestRecord(0.0, times, 10.0), RequestRecord(0.5, [1.0, 1.1], 10.0)], makespan=2.0)
    assert s["ttft_mean"] == pytest.approx(0.75) and s["throughput"] == pytest.approx(3.0)
    assert s["rebuffer_mean"] == pytest.approx(0.35) and s["completed"] == s["requests"] == 2


def drive(engine, arrivals: list[tuple[float, int, int, float]]) -> list:
    """Run (arrival, prompt_len, output_len, read_rate) requests on a simulated engine to the end."""
    pending, reqs = sorted(arrivals), []
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= engine.clock():
            t, p, n, rate = pending.pop(0)
            reqs.append(engine.add_request([1] * p, SamplingParams(max_tokens=n, ignore_eos=True, read_rate=rate),
                                           arrival_time=t))
        if engine.has_unfinished():
            engine.step()
        else:
            engine.clock.advance_to(pending[0][0])
    return reqs


def test_motivating_example():
    """TokenFlow's Figure: two slots, each running request decoding at 40 tok/s (so 80 tok/s in all);
    R1 reads at 20 tok/s and R2 at 30 from t=0; R3 (25 tok/s) arrives at t=2."""
    toy = CostModel("toy", SMOLLM2_135M, 1024, overhead_s=1 / 40, weights_read_s=0, per_kv_token_s=0,
                    per_prefill_token_s=0, per_decode_seq_s=0, link_bytes_per_s=1e9, num_kv_blocks=64,
                    num_host_blocks=1000, max_num_seqs=2)
    arrivals = [(0.0, 16, 300, 20.0), (0.0, 16, 300, 30.0), (2.0, 16, 300, 25.0)]
    quick = TokenFlowConfig(interval=0.5)  # Δt at the toy's time scale (a 300-token answer lasts 7.5 s)
    runs = {policy: drive(build_engine(toy, policy, tokenflow=quick), arrivals) for policy in ("fcfs", "tokenflow")}
    ttft = {policy: reqs[2].token_times[0] - reqs[2].arrival_time for policy, reqs in runs.items()}
    assert ttft["fcfs"] > 5.0  # R3 waits for R1 to finish its 300 tokens
    assert ttft["tokenflow"] < 0.1 * ttft["fcfs"]
    assert all(rebuffer_time(r.token_times, r.read_rate) == 0 for r in runs["tokenflow"])
    assert all(len(r.token_times) == 300 for reqs in runs.values() for r in reqs)


def burst(n: int, rate: float, seed: int = 0) -> list[tuple[float, int, int, float]]:
    rng = random.Random(seed)
    return [(0.0, rng.randint(50, 150), rng.randint(100, 200), rate) for _ in range(n)]


def test_tokenflow_preempts_only_what_can_wait_and_never_swaps_back_and_forth():
    engine = build_engine("cpu-smollm2", "tokenflow")
    s, decisions, moves = engine.scheduler, [], {}
    real_rebalance, real_preempt = s._rebalance, s.preempt

    def rebalance(now):
        s.deciding = True
        out = real_rebalance(now)
        s.deciding = False
        return out

    def preempt(req):
        now = engine.clock()
        if getattr(s, "deciding", False):  # the policy's own choice (not a pool that ran dry under growth)
            decisions.append((req.time_to_stall(now), s.config.mu * s._switch_time(req)))
        moves.setdefault(req, []).append(now)
        real_preempt(req)

    s._rebalance, s.preempt = rebalance, preempt
    reqs = drive(engine, burst(40, rate=2.0))  # 80 tok/s of readers, ~120 tok/s of capacity
    assert len(decisions) > 20 and all(stall >= needed for stall, needed in decisions)
    for times in moves.values():  # consecutive preemptions of one request are an interval apart at least
        assert all(b - a >= s.config.interval for a, b in zip(times, times[1:]))
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert engine.stats()["resumes_load"] > 0 and engine.kv.num_free == engine.kv.num_blocks


def test_tokenflow_beats_fcfs_on_a_burst_and_degrades_to_fcfs_past_capacity():
    within = {}
    for policy in ("fcfs", "tokenflow"):
        engine = build_engine("cpu-smollm2", policy)
        within[policy] = summarize([r.record() for r in drive(engine, burst(40, 2.0))], engine.clock())
    assert within["tokenflow"]["ttft_p99"] < 0.5 * within["fcfs"]["ttft_p99"]
    assert within["tokenflow"]["rebuffer_mean"] < within["fcfs"]["rebuffer_mean"]
    # readers at 20 tok/s x 40 = 800 tok/s of demand against ~120 of capacity: no newcomer is let in by
    # preemption, so tokenflow preempts only when running requests outgrow the pool, as fcfs does
    over = {}
    for policy in ("fcfs", "tokenflow"):
        engine = build_engine("cpu-smollm2", policy)
        reqs = drive(engine, burst(40, 20.0))
        assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
        over[policy] = engine.stats()["preemptions"]
    assert over["tokenflow"] <= over["fcfs"]


# ---------------------------------------------------------------- bench.py: a tiny run of each mode
# Each mode runs the same few short requests on the tiny checkpoint (or the CPU preset) and must print
# the side-by-side table and write JSON whose numbers are finite and consistent. No timing is asserted.

import importlib.util  # noqa: E402
import math  # noqa: E402

import bench  # noqa: E402

BENCH_WORKLOAD = ["--burst", "4", "--prompt-len", "12:2", "--output-len", "10:2", "--seed", "1"]


def check_bench_output(out: str, path, policies: list[str]) -> None:
    assert "TTFT p99 (s)" in out and "effective throughput" in out and all(p in out for p in policies)
    report = json.loads(path.read_text())
    assert report["config"]["burst"] == 4 and list(report["policies"]) == policies
    for m in report["policies"].values():
        assert all(key in m and math.isfinite(m[key]) for key in bench.METRIC_KEYS)
        assert m["completed"] == m["requests"] == 4
        assert m["ttft_p50"] <= m["ttft_p99"] and m["rebuffer_mean"] >= 0 and 0 <= m["qoe_good_share"] <= 1
        assert 0 < m["effective_throughput"] <= m["throughput"] and m["makespan"] > 0


def test_bench_in_process(ckpt, tmp_path, capsys):
    path = tmp_path / "bench.json"
    bench.main(["--ckpt", str(ckpt), "--device", "cpu", *BENCH_WORKLOAD, "--json", str(path)])
    out = capsys.readouterr().out
    check_bench_output(out, path, ["fcfs", "tokenflow"])
    assert "tokenflow/fcfs" in out and "readers: a running request decodes at" in out  # auto rates, explained
    tokens = [m["throughput"] * m["makespan"] for m in json.loads(path.read_text())["policies"].values()]
    assert tokens[0] == pytest.approx(tokens[1])  # the identical workload: every output ran to its length


def test_bench_simulate_with_plot(tmp_path, capsys):
    path, png = tmp_path / "sim.json", tmp_path / "sim.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    bench.main(["--simulate", "--preset", "cpu-smollm2", *BENCH_WORKLOAD, "--read-rate", "15:0.4,20:0.6",
                "--json", str(path), *plot])
    check_bench_output(capsys.readouterr().out, path, ["fcfs", "tokenflow"])
    assert not plot or png.read_bytes().startswith(b"\x89PNG")


def test_bench_http(ckpt, tmp_path, capsys):
    srv = make_server(LLM(ckpt, device="cpu", num_kv_blocks=64), "127.0.0.1", 0, model="tiny").start()
    try:
        path = tmp_path / "http.json"
        bench.main(["--http", srv.url, *BENCH_WORKLOAD, "--read-rate", "20", "--json", str(path)])
        check_bench_output(capsys.readouterr().out, path, ["http"])
    finally:
        srv.shutdown()


def test_bench_gpu_modes_explain_themselves_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: these modes would measure it")
    bench.main(["--kernels", "--transfers"])
    assert capsys.readouterr().out.count("needs a CUDA GPU") == 2


class SlowCopy:
    """A stand-in for a CUDA event: its copy is done once waited for, or after a few polls."""

    def __init__(self):
        self.done, self.polls = False, 0

    def query(self) -> bool:
        self.polls += 1
        return self.done or self.polls > 3

    def synchronize(self) -> None:
        self.done = True


def test_short_pool_waits_for_evicted_blocks_instead_of_evicting_everyone(tiny):
    """As on a GPU, evicted blocks come back only when their copies finish: one eviction must be enough."""
    path, _ = tiny
    llm = LLM(path, device="cpu", num_kv_blocks=8, host_kv_gb=0.01, policy="fcfs")
    engine, swapper = llm.engine, llm.engine.scheduler.swapper
    swapper.pending_event = SlowCopy  # fcfs recomputes, but its freed blocks still wait for "copies in flight"
    reqs = [engine.add_request([5] * 31, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for _ in range(4)]
    for _ in range(3):  # prefill (2 blocks each: all 8 used), a decode, then every request needs a third block
        engine.step()
    assert engine.stats()["preemptions"] == 2 and len(engine.scheduler.running) == 2
    while engine.has_unfinished():
        engine.step()
    swapper.complete_all()
    assert all(r.num_output_tokens == 8 for r in reqs) and engine.kv.num_free == engine.kv.num_blocks
