"""nanoflow's test suite. Runs on a 2-core CPU without a GPU; CUDA-only tests are marked and skipped.

Oracles: HuggingFace transformers for the model and tokenizer, the torch references for the Triton
kernels, an uninterrupted run for anything that batches, chunks or preempts.
"""

import json
import os
import random

import torch

# Read by triton.jit when the kernels are defined, so it must be set before nanoflow imports triton:
# kernels run in Triton's interpreter on CPU tensors without a GPU, compiled on CUDA with one.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from nanoflow import LLM, SamplingParams, attention  # noqa: E402
from nanoflow.attention import AttnMetadata  # noqa: E402
from nanoflow.model import IncrementalDetokenizer, demo_checkpoint  # noqa: E402

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


def test_small_pool_preempts_by_recompute_and_frees_everything(tiny):
    path, _ = tiny
    prompts = random_prompts(8, TINY["vocab_size"], seed=4, lengths=(20, 60))
    expected = [o.token_ids for o in LLM(path, device="cpu", num_kv_blocks=128).generate(prompts, GREEDY)]
    small = LLM(path, device="cpu", num_kv_blocks=12)  # 192 slots; the 8 requests need ~600
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
