"""nanoflow's test suite. Runs on a 2-core CPU without a GPU; CUDA-only tests are marked and skipped.

Oracles: HuggingFace transformers for the model and tokenizer, the torch references for the Triton
kernels, an uninterrupted run for anything that batches, chunks or preempts.
"""

import json
import random

import pytest
import torch

from nanoflow import LLM, SamplingParams
from nanoflow.model import IncrementalDetokenizer, demo_checkpoint

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
