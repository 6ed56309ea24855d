"""nanoflow's offline speed against transformers' (docs/results.md, "Offline speed").

    python tools/vs_transformers.py [--ckpt PATH] [--dtype auto] [--batch-sizes 1,16]

The same random prompts through `LLM.generate` and transformers' `generate`, greedy, to a fixed
length; tokens/s of each and their ratio, per batch size.
"""

import argparse
import functools
import random
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import seconds  # noqa: E402
from benchmarks.workloads import parse_dist  # noqa: E402
from nanoflow import LLM, SamplingParams  # noqa: E402
from nanoflow.model import demo_checkpoint  # noqa: E402


def hf_generate(hf, prompts: list[list[int]], n_new: int) -> torch.Tensor:
    """transformers' greedy generate of exactly n_new tokens after each prompt."""
    return hf.eval().generate(
        torch.tensor(prompts),
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        do_sample=False,
        pad_token_id=0,
    )


def vs_transformers(args: argparse.Namespace) -> None:
    """LLM.generate against transformers' generate: the same prompts, greedy, to a fixed length."""
    path = Path(args.ckpt) if args.ckpt else demo_checkpoint()
    llm = LLM(path, dtype=args.dtype)
    model = llm.engine.runner.model
    dtype = model.model.embed_tokens.weight.dtype  # what auto chose, for both engines
    print(f"dtype: {dtype}")
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, dtype=dtype, **gguf)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    n_new = args.new_tokens
    prompt_len = round(parse_dist(args.prompt_len)[0])
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    print(f"{'prompts':>8} {'nanoflow tok/s':>15} {'transformers tok/s':>19} {'ratio':>6}")
    for n in map(int, args.batch_sizes.split(",")):
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        ours = n * n_new / seconds(functools.partial(llm.generate, prompts, params))
        with torch.no_grad():
            theirs = n * n_new / seconds(functools.partial(hf_generate, hf, prompts, n_new))
        print(f"{n:>8} {ours:>15.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ckpt", help="checkpoint folder or .gguf (default: the demo model)")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    ap.add_argument("--prompt-len", default="128", help="prompt tokens (default: 128)")
    ap.add_argument("--batch-sizes", default="1,16", help="prompts per generate call")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt")
    vs_transformers(ap.parse_args())
