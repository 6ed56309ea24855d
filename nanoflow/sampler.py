"""The sampler: one next token per request from the logits of the step's batch.

Logit bias, min_tokens, the repetition/frequency/presence penalties and the grammars of
constrained requests (grammar.py) shape the logits; temperature, top_k, min_p and top_p shape
each row's distribution; greedy rows take the argmax. Everything runs on the whole batch at
once, with per-request seeds honoured. It may import grammar.
"""

import torch
from torch import Tensor

from .grammar import apply_bitmasks


def sample(logits: Tensor, reqs: list, eos_token_ids: list[int] = ()) -> list[int]:
    """One token per row of logits [rows, vocab]. Greedy rows take the argmax; the others race
    exponential noise: argmax(p / q) with q ~ Exp(1) draws from p, the whole batch at once."""
    params = [r.params for r in reqs]
    logits = processed_logits(logits, reqs, eos_token_ids)
    greedy = logits.argmax(-1)
    sampled = torch.tensor([p.temperature > 0 for p in params], device=logits.device)
    if not sampled.any():
        return greedy.tolist()
    q = torch.empty_like(logits).exponential_()
    for i, req in enumerate(reqs):
        if req.generator is not None and params[i].temperature > 0:
            q[i].exponential_(generator=req.generator)
    drawn = (sampling_probs(logits, params) / q.clamp_min(torch.finfo(q.dtype).tiny)).argmax(-1)
    return torch.where(sampled, drawn, greedy).tolist()


def processed_logits(logits: Tensor, reqs: list, eos_token_ids: list[int]) -> Tensor:
    """The logits after logit_bias, min_tokens (EOS, stop_token_ids banned), penalties
    (vLLM's), then each constrained row's grammar."""
    params = [r.params for r in reqs]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
    if bias:
        rows, ids, values = zip(*bias)
        index = (_tensor(logits, rows), _tensor(logits, ids))
        logits = logits.index_put(index, _tensor(logits, values), accumulate=True)
    banned = [
        (i, t)
        for i, (r, p) in enumerate(zip(reqs, params))
        if r.num_output_tokens < p.min_tokens
        for t in (*eos_token_ids, *p.stop_token_ids)
    ]
    if banned:
        rows, ids = zip(*banned)
        index = (_tensor(logits, rows), _tensor(logits, ids))
        logits = logits.index_put(index, _tensor(logits, float("-inf")).expand(len(rows)))
    penalized = [
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params
    ]
    if any(penalized):
        logits = _penalize(logits, reqs, penalized)
    constrained = any(p.json_schema is not None for p in params)
    return apply_bitmasks(logits, reqs) if constrained else logits


def _penalize(logits: Tensor, reqs: list, penalized: list[bool]) -> Tensor:
    """Repetition (prompt and output), frequency and presence (output) penalties, batched."""
    params = [r.params for r in reqs]
    outputs = [r.output_token_ids if on else [] for r, on in zip(reqs, penalized)]
    counts = _token_counts(logits, outputs)
    prompts = [r.prompt_token_ids if on else [] for r, on in zip(reqs, penalized)]
    seen = (_token_counts(logits, prompts) > 0) | (counts > 0)
    rep = _column(logits, [p.repetition_penalty for p in params])
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (
        logits
        - _column(logits, [p.frequency_penalty for p in params]) * counts
        - _column(logits, [p.presence_penalty for p in params]) * (counts > 0)
    )


def _token_counts(logits: Tensor, seqs: list[list[int]]) -> Tensor:
    """[rows, vocab]: how often each token occurs in each row's sequence (one scatter, padded)."""
    rows, vocab = logits.shape
    padded = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(s, dtype=torch.long) for s in seqs], batch_first=True, padding_value=vocab
    )
    ids = padded.to(logits.device)
    counts = torch.zeros(rows, vocab + 1, device=logits.device, dtype=logits.dtype)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab]


def _tensor(logits: Tensor, values) -> Tensor:
    return torch.tensor(values, device=logits.device)


def _column(logits: Tensor, values: list) -> Tensor:
    return _tensor(logits, values)[:, None]


def sampling_probs(logits: Tensor, params: list) -> Tensor:
    """Each row's distribution: softmax(logits / temperature), then min_p and top_k (both keep
    a head of the sorted order), renormalized, then top_p (the smallest head reaching that mass)."""
    vocab = logits.shape[-1]
    # greedy rows get some valid distribution here; sample() takes their argmax instead
    temperature = _column(logits, [p.temperature or 1.0 for p in params])
    if all(p.top_k in (-1, 0) and p.top_p == 1 and p.min_p == 0 for p in params):
        return (logits / temperature).softmax(-1)  # nothing to cut: no sort
    top_k = _column(logits, [p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = _column(logits, [p.top_p if p.top_p < 1 else float("inf") for p in params])
    min_p = _column(logits, [p.min_p for p in params])
    probs, order = (logits / temperature).softmax(-1).sort(-1, descending=True)
    keep = (torch.arange(vocab, device=logits.device) < top_k) & (probs >= min_p * probs[:, :1])
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    probs = probs * (probs.cumsum(-1) - probs < top_p)
    return torch.zeros_like(probs).scatter_(-1, order, probs / probs.sum(-1, keepdim=True))


def token_logprobs(logits: Tensor, tokens: list[int], num_top: int) -> list[tuple[float, list]]:
    """Per row: the chosen token's logprob and the num_top likeliest (id, logprob), from the
    raw logits (as vLLM reports them: before penalties and temperature)."""
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(1, _column(logits, tokens))[:, 0].tolist()
    top = logprobs.topk(num_top, -1)
    return [
        (c, list(zip(ids, values)))
        for c, ids, values in zip(chosen, top.indices.tolist(), top.values.tolist())
    ]
