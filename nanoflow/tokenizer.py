"""Text in and out: the tokenizer, the chat template, and the detokenizer that streams text.

A HuggingFace folder's tokenizer.json and a GGUF file's byte-level BPE vocabulary both become
the same `Tokenizer`: encode, decode, the EOS ids and the model's own chat template (rendered
in a sandbox). `IncrementalDetokenizer` turns each new token into the text it adds, never half
a character, for streaming. It imports no nanoflow module.
"""

import json
from pathlib import Path


GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2's and Llama 3's split, which differ only in how many digits make one piece (%s)
NEWER_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PRETOKENIZERS = {  # tokenizer.ggml.pre -> (split regex, split every digit first, NFC normalize)
    "smollm": (GPT2_SPLIT, True, False),
    "gpt2": (GPT2_SPLIT, False, False),
    "qwen2": (NEWER_SPLIT % "", False, True),
    "llama-bpe": (NEWER_SPLIT % "{1,3}", False, False),
}
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: BOS, EOS ids and the chat template."""

    def __init__(
        self,
        tk,
        chat_template: str | None,
        bos_token: str | None,
        eos_token_ids: list[int],
        add_bos: bool,
    ):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos

    @classmethod
    def from_folder(cls, ckpt: Path, eos_token_ids: list[int]) -> "Tokenizer":
        from tokenizers import Tokenizer as TK

        tk = TK.from_file(str(ckpt / "tokenizer.json"))
        cfg_path = ckpt / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if (ckpt / "chat_template.jinja").exists():
            template = (ckpt / "chat_template.jinja").read_text()
        gen_path = ckpt / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id", eos_token_ids)
            eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        bos = _token_text(cfg.get("bos_token"))
        eos_id = tk.token_to_id(_token_text(cfg.get("eos_token")) or "")
        if eos_id is not None and eos_id not in eos_token_ids:
            eos_token_ids = [*eos_token_ids, eos_id]
        # tokenizer.json's post-processor already adds BOS where the model wants it
        return cls(tk, template, bos, eos_token_ids, add_bos=False)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
        from tokenizers import Tokenizer as TK

        def field(key: str, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer {model!r}; only 'gpt2' (byte-level BPE)")
        pre = field("tokenizer.ggml.pre", "gpt2")
        if pre not in PRETOKENIZERS:
            raise ValueError(
                f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(PRETOKENIZERS)}"
            )
        tokens = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = TK(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        split, digits, nfc = PRETOKENIZERS[pre]
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        if nfc:
            tk.normalizer = normalizers.NFC()
        tk.decoder = decoders.ByteLevel()
        types = field("tokenizer.ggml.token_type")
        control = [tokens[i] for i, kind in enumerate(types) if kind == 3]  # 3 = control token
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        # 4 = user-defined: matched whole and decoded as text (Qwen3's <think>, </think>)
        user = [tokens[i] for i, kind in enumerate(types) if kind == 4]
        tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        eos = [field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        eos += [tk.token_to_id(t) for t in END_OF_TURN if t in control]
        bos_id = field("tokenizer.ggml.bos_token_id")
        bos = None if bos_id is None else tokens[bos_id]
        # this family's byte-level BPE (SmolLM2, Qwen2) has no BOS, whatever the GGUF says (as HF)
        add_bos = pre == "llama-bpe" and bos is not None
        eos_ids = sorted(set(eos) - {None})
        return cls(tk, field("tokenizer.chat_template"), bos, eos_ids, add_bos)

    def encode(self, text: str) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=True).ids
        if self.add_bos:
            ids = [self.tk.token_to_id(self.bos_token), *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        """Render the checkpoint's own template (sandboxed jinja2) and tokenize it as is; kwargs
        are more template variables (vLLM's chat_template_kwargs, e.g. enable_thinking)."""
        if not self.chat_template:
            raise ValueError(
                "this checkpoint has no chat template; use generate() with a plain prompt"
            )
        text = _render_template(self.chat_template, messages, self.bos_token or "", kwargs)
        return self.tk.encode(text, add_special_tokens=False).ids


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _render_template(template: str, messages: list[dict], bos_token: str, kwargs: dict) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        {**kwargs, "messages": messages, "bos_token": bos_token, "add_generation_prompt": True}
    )


class IncrementalDetokenizer:
    """Streams text token by token, never half a UTF-8 character. Decodes a short window (vLLM's
    prefix/read offsets): the text of ids[prefix:] minus that of ids[prefix:read] is what the newest
    tokens added; a trailing U+FFFD means a character is incomplete: wait for the next token."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = self.read_offset = 0

    def step(self, ids: list[int]) -> str:
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return new_text[len(prefix_text) :]

    def flush(self, ids: list[int]) -> str:
        """What is held back when the request ends (an unfinished character included)."""
        prefix_text = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        return new_text[len(prefix_text) :]
