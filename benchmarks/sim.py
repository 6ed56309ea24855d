"""The simulator: the real scheduler, KV accounting and metrics on a virtual clock.

Only two things are modelled. A step's time comes from a cost model of what it computes (prefill
tokens, decoding requests, KV tokens read); a transfer's time is its bytes over the host link,
transfers queueing one behind the other. Everything else is the engine's own code: `Scheduler`
(both policies), `KVPool` block accounting in both pools, `Swapper`'s write-through/evict/load
bookkeeping, `Request` readers and `metrics`. So thousands of requests at H200 scale run in seconds
on a laptop, and what the simulator says about a policy is what that policy does.
"""

import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from nanoflow.engine import Engine
from nanoflow.request import Request
from nanoflow.kv import KVPool, kv_block_bytes
from nanoflow.model import ModelConfig
from nanoflow.policies import TokenFlowConfig, make_policy
from nanoflow.request import SamplingParams
from nanoflow.sched import Policy, Scheduler
from nanoflow.swap import Lane, Swapper

SIM_TOKEN = 0  # the token every simulated step "samples"; workloads run with ignore_eos


class VirtualClock:
    """A clock that moves only when told: by a step's modelled time, or to the next arrival."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class StepTerms(NamedTuple):
    """What a step computes, in the cost model's terms."""

    prefill_tokens: int
    decodes: int
    kv_tokens: int  # KV tokens attended, every request's context and its new tokens
    prompt_pairs: int  # (query, key) pairs of the prompt chunks: their attention grows as n^2

    @classmethod
    def of(cls, scheduled) -> "StepTerms":
        """The terms of (request, new tokens) pairs, before the step computes them."""
        chunks = [(r.num_computed_tokens, n) for r, n in scheduled]
        return cls(
            sum(n for _, n in chunks if n > 1),
            sum(n == 1 for _, n in chunks),
            sum(done + n for done, n in chunks),
            sum(prompt_pairs(done, n) for done, n in chunks if n > 1),
        )


@dataclass
class CostModel:
    """Step time = overhead + max(memory time, compute time); each number says where it is from."""

    name: str
    model: ModelConfig
    kv_bytes_per_token: int
    overhead_s: float  # per step, whatever the batch: scheduling, launches, sampling
    weights_read_s: float  # reading every weight once per step
    per_kv_token_s: float  # reading one token's KV (all layers) in attention
    per_prefill_token_s: float  # compute per prompt token
    per_decode_seq_s: float  # compute per decoding request
    link_bytes_per_s: float  # host <-> device copies
    num_kv_blocks: int
    num_host_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    notes: list[str] = field(default_factory=list)
    # a CPU's attention: compute per KV token attended and per prompt (query, key) pair, added to
    # the compute (a GPU's is memory)
    per_attended_token_s: float = 0.0
    per_prompt_pair_s: float = 0.0
    async_copies: bool = True  # copies run beside compute (a GPU's side streams; a CPU has none)

    def step_time(self, step: StepTerms) -> float:
        memory = self.weights_read_s + step.kv_tokens * self.per_kv_token_s
        compute = step.prefill_tokens * self.per_prefill_token_s
        compute += step.decodes * self.per_decode_seq_s
        compute += step.kv_tokens * self.per_attended_token_s
        compute += step.prompt_pairs * self.per_prompt_pair_s
        return self.overhead_s + max(memory, compute)

    def describe(self) -> str:
        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.3g} ms"

        memory = f"{ms(self.weights_read_s)} + kv_tokens x {self.per_kv_token_s * 1e9:.3g} ns"
        compute = (
            f"prefill_tokens x {ms(self.per_prefill_token_s)} + "
            f"decodes x {ms(self.per_decode_seq_s)}"
        )
        if self.per_attended_token_s:
            compute += f" + kv_tokens x {self.per_attended_token_s * 1e9:.3g} ns"
        if self.per_prompt_pair_s:
            compute += f" + prompt_pairs x {self.per_prompt_pair_s * 1e9:.3g} ns"
        pools = f"{self.num_kv_blocks} device + {self.num_host_blocks} host blocks"
        line = (
            f"preset {self.name}: step = {ms(self.overhead_s)} + max({memory}, {compute}); "
            f"host link {self.link_bytes_per_s / 1e9:.3g} GB/s; KV {pools} of "
            f"{self.block_size} tokens"
        )
        return "\n".join([line] + [f"  - {n}" for n in self.notes])


LLAMA3_8B = ModelConfig(
    "LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
)
SMOLLM2_135M = ModelConfig(
    "LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return kv_block_bytes(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, dtype)


def h200_llama3_8b() -> CostModel:
    hbm, flops, link = 4.3e12, 790e12, 50e9
    weights = 8.03e9 * 2  # Llama-3-8B parameters, bf16
    kv_token = kv_bytes_per_token(LLAMA3_8B, torch.bfloat16)  # 128 KiB
    # the paper's 0.3 memory fraction, less the weights and ~2 GB of activations
    kv_budget = 141e9 * 0.3 - weights - 2e9
    return CostModel(
        "h200-llama3-8b",
        LLAMA3_8B,
        kv_token,
        overhead_s=1.5e-3,
        weights_read_s=weights / hbm,
        per_kv_token_s=kv_token / hbm,
        per_prefill_token_s=2 * 8.03e9 / flops,
        per_decode_seq_s=2 * 8.03e9 / flops,
        link_bytes_per_s=link,
        num_kv_blocks=int(kv_budget // (16 * kv_token)),
        num_host_blocks=int(100e9 // (16 * kv_token)),
        notes=[
            "HBM 4.3 TB/s: the H200's measured device copy rate; 16.06 GB of weights read once "
            "per step",
            "790 TFLOP/s: measured dense bf16 matmul rate; 2 x 8.03e9 FLOP/token",
            "KV 128 KiB/token (32 layers x K,V x 8 heads x 128 x bf16), read once per step",
            "KV pool: 0.3 x 141 GB - weights - 2 GB activations (the paper's memory fraction)",
            "host link 50 GB/s: PCIe Gen5 x16 with pinned memory (assumed, ~80% of 64 GB/s); "
            "host KV 100 GB",
            "1.5 ms per step for scheduling, launches and sampling (assumed)",
        ],
    )


def cpu_smollm2() -> CostModel:
    return CostModel(
        "cpu-smollm2",
        SMOLLM2_135M,
        kv_bytes_per_token(SMOLLM2_135M, torch.float32),
        overhead_s=0.050,
        weights_read_s=0.0,
        per_kv_token_s=0.0,
        per_prefill_token_s=1.7e-3,
        per_decode_seq_s=4.7e-3,
        link_bytes_per_s=5e9,
        num_kv_blocks=256,
        num_host_blocks=4096,
        async_copies=False,
        notes=[
            "fitted to the real engine, fp32 demo model, 2-core machine (AMD EPYC, 2026-11):",
            "decode step 56 ms at 1 request, 126 ms at 16; a 2048-token prefill step 3.45 s",
            "host link 5 GB/s: memcpy between two CPU buffers; `bench.py --calibrate` refits",
        ],
    )


QWEN25_32B = ModelConfig(
    "qwen2",
    vocab_size=152064,
    hidden_size=5120,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
)
ALLREDUCE_LATENCY_S = 20e-6  # per all-reduce over PCIe (assumed): two per layer, 128 per step


def tp_qwen32b(card: str, gpus: int, memory: float, hbm: float, flops: float, bus: float):
    """Qwen2.5-32B in bf16 over `gpus` cards (all-reduce at `bus` bytes/s), one rank's costs."""
    params, layers, link = 32.5e9, QWEN25_32B.num_hidden_layers, 25e9
    weights = params * 2 / gpus
    kv_token = kv_bytes_per_token(QWEN25_32B, torch.bfloat16) // gpus
    # per token: its share of the matmuls, two ring all-reduces per layer of its bf16 hidden state
    hidden_bytes = QWEN25_32B.hidden_size * 2
    per_token = 2 * params / gpus / flops + 4 * layers * (gpus - 1) / gpus * hidden_bytes / bus
    return CostModel(
        f"{gpus}x{card}-qwen2.5-32b",
        QWEN25_32B,
        kv_token,
        overhead_s=1.5e-3 + 2 * layers * ALLREDUCE_LATENCY_S,
        weights_read_s=weights / hbm,
        per_kv_token_s=kv_token / hbm,
        per_prefill_token_s=per_token,
        per_decode_seq_s=per_token,
        link_bytes_per_s=link,
        num_kv_blocks=int((memory * 0.9 - weights - 2e9) // (16 * kv_token)),
        num_host_blocks=int(64e9 / gpus // (16 * kv_token)),
        notes=[
            f"{memory / 1e9:.0f} GB, {hbm / 1e9:.0f} GB/s, {flops / 1e12:.1f} TFLOP/s per GPU "
            "(spec sheets, no efficiency factor); 65 GB of weights, 1/N per rank",
            f"all-reduce {bus / 1e9:.0f} GB/s, {ALLREDUCE_LATENCY_S * 1e6:.0f} us (assumed), "
            "not overlapped; KV pool: 0.9 x memory - weights - 2 GB; host link 25 GB/s",
        ],
    )


PRESETS = {
    "h200-llama3-8b": h200_llama3_8b,
    "cpu-smollm2": cpu_smollm2,
    # A6000 pairs over PCIe Gen4; 4090s: half-rate fp32 accumulation, no peer-to-peer
    "2xa6000-qwen2.5-32b": lambda: tp_qwen32b("a6000", 2, 48e9, 768e9, 154.8e12, 20e9),
    "4x4090-qwen2.5-32b": lambda: tp_qwen32b("4090", 4, 24e9, 1008e9, 82.6e12, 10e9),
}


class _NoText:
    eos_token_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return ""


@dataclass
class VirtualEvent:
    """A CUDA event's stand-in: a modelled copy that is done at `at` on the virtual clock."""

    at: float
    clock: VirtualClock

    def query(self) -> bool:
        return self.clock() >= self.at

    def synchronize(self) -> None:
        """The host waits for the copy: virtual time passes."""
        self.clock.advance_to(self.at)


class SimSwapper(Swapper):
    """Transfers as time on a virtual host link, each direction its own queue (bytes / bandwidth,
    in order; the link is full duplex); the books are Swapper's. Blocks being copied return to
    their pool, and loaded requests may run, once their copy is done."""

    def __init__(
        self,
        device: KVPool,
        host: KVPool,
        clock: VirtualClock,
        link_bytes_per_s: float,
        async_copies: bool = True,
    ):
        self.device, self.host, self.clock = device, host, clock
        self.block_bytes, self.bandwidth = device.bytes_per_block, link_bytes_per_s
        self.out, self.back = Lane(None, []), Lane(None, [])  # never in flight: time is modelled
        self.free_at = {"out": 0.0, "back": 0.0}  # when each direction's queue is done
        self.filled_at: dict[int, float] = {}  # host block -> when the copy that fills it is done
        self.writing, self.counters = {}, Counter()
        self.async_copies = async_copies  # as the modelled engine's (sched.py asks)
        self.link_tiers()

    def _occupy(self, direction: str, num_blocks: int, after: float = 0.0) -> float:
        """When a copy queued now in this direction (starting no sooner than `after`) is done."""
        start = max(self.free_at[direction], self.clock(), after)
        self.free_at[direction] = start + num_blocks * self.block_bytes / self.bandwidth
        if not self.async_copies:  # a CPU copies on the engine's own thread: the engine waits
            self.clock.advance_to(self.free_at[direction])
        return self.free_at[direction]

    def copy_to_host(self, dev_ids: list[int], host_ids: list[int]) -> None:
        self.filled_at.update(dict.fromkeys(host_ids, self._occupy("out", len(dev_ids))))
        self.counters["bytes_to_host"] += len(dev_ids) * self.block_bytes

    def copy_to_device(self, host_ids: list[int], dev_ids: list[int]) -> VirtualEvent:
        """A load starts once the copies that fill its host blocks are done (as Swapper._load)."""
        self.counters["bytes_to_device"] += len(host_ids) * self.block_bytes
        filled = max((self.filled_at.get(h, 0.0) for h in host_ids), default=0.0)
        return VirtualEvent(self._occupy("back", len(host_ids), filled), self.clock)

    def pending_event(self) -> VirtualEvent | None:
        return VirtualEvent(max(self.free_at.values()), self.clock) if self.backlog() else None

    def backlog(self, lane: Lane | None = None) -> float:
        ends = [self.free_at["back"]] if lane is self.back else self.free_at.values()
        return max(0.0, max(ends) - self.clock())


class ChargedScheduler(Scheduler):
    """The scheduler, its own CPU time charged to the virtual clock: deciding is not free."""

    def schedule(self) -> list[tuple[Request, int]]:
        start = time.perf_counter()
        out = super().schedule()
        self.clock.advance_to(self.clock() + time.perf_counter() - start)
        return out


class SimEngine(Engine):
    """The engine with the forward replaced by the cost model."""

    def __init__(
        self,
        cost: CostModel,
        scheduler: Scheduler,
        read_rate: float,
        jitter: float = 0.0,
        seed: int = 0,
    ):
        super().__init__(None, cost.model, _NoText(), scheduler, read_rate)
        self.cost = cost
        self.jitter, self.rng = jitter, random.Random(seed)

    def idle(self) -> None:
        self.clock.advance_to(self.clock() + self.cost.overhead_s)

    def wait_for_loads(self, batch) -> None:
        for r in batch.reqs:
            r.load_event = None  # the scheduler runs a loaded request only once its copy is done

    def run(self, batch) -> list[int]:
        step_s = self.cost.step_time(StepTerms.of(zip(batch.reqs, batch.query_lens)))
        if self.jitter:  # a real device's steps vary by a few percent
            step_s *= 1 + self.rng.uniform(-self.jitter, self.jitter)
        self.clock.advance_to(self.clock() + step_s)
        return [SIM_TOKEN] * len(batch.sampled)


def _pool(num_blocks: int, block_size: int, bytes_per_block: int, host: bool) -> KVPool:
    """Block accounting without the memory: one element per slot, the modelled block bytes."""
    pool = KVPool(num_blocks, 1, block_size, 1, 1, torch.float32, torch.device("cpu"), host=host)
    pool.bytes_per_block = bytes_per_block
    return pool


def build_engine(
    preset: str | CostModel,
    policy: str | Policy,
    read_rate: float = 8.0,
    num_kv_blocks: int | None = None,
    tokenflow: TokenFlowConfig | None = None,
    charge_scheduler: bool = True,
    host_kv_gb: float | None = None,
    enable_prefix_caching: bool = True,
    jitter: float = 0.0,
    seed: int = 0,
) -> SimEngine:
    """A simulated engine; charge_scheduler=False leaves the scheduler's own time out (runs repeat
    exactly). host_kv_gb (GiB) replaces the preset's host pool. jitter: each step's time is scaled
    by a factor drawn uniformly from [1 - jitter, 1 + jitter] (a generator seeded by seed)."""
    cost = PRESETS[preset]() if isinstance(preset, str) else preset
    clock = VirtualClock()
    block_bytes = cost.block_size * cost.kv_bytes_per_token
    device = _pool(num_kv_blocks or cost.num_kv_blocks, cost.block_size, block_bytes, host=False)
    host_blocks = cost.num_host_blocks
    if host_kv_gb is not None:
        host_blocks = int(host_kv_gb * (1 << 30)) // block_bytes
    swapper = None
    if host_blocks:
        host = _pool(host_blocks, cost.block_size, block_bytes, host=True)
        swapper = SimSwapper(device, host, clock, cost.link_bytes_per_s, cost.async_copies)
    scheduler = (ChargedScheduler if charge_scheduler else Scheduler)(
        device,
        cost.max_num_seqs,
        cost.max_num_batched_tokens,
        clock,
        make_policy(policy, tokenflow),
        swapper,
        enable_prefix_caching,
    )
    return SimEngine(cost, scheduler, read_rate, jitter, seed)


Step = tuple[StepTerms, float]  # what a step computed, and the seconds it took
IDLE_FACTOR = 2.0  # a gap this many times the fitted step is a step and then a wait for arrivals


def prompt_pairs(done: int, n: int) -> int:
    """The (query, key) pairs of a prompt chunk of n tokens after done computed ones (causal)."""
    return n * (done + (n + 1) // 2)


def calibration_steps(
    llm, prompt_lens=(64, 256, 1024), batches=(1, 4, 16), contexts=(128, 512), decode_steps: int = 8
) -> list[Step]:
    """The real engine's steps for a fit: prompts alone, and decodes of each batch at two context
    lengths (which tell the per-request and the per-KV-token terms apart)."""
    engine = llm.engine
    vocab = engine.config.vocab_size
    steps = []

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    for p in (min(p, engine.max_model_len - 2) for p in prompt_lens):
        engine.add_request([(7 * i) % vocab for i in range(p)], params(1))
        steps.append((StepTerms(p, 0, p, prompt_pairs(0, p)), timed_step()))
    for context in (min(c, engine.max_model_len - decode_steps - 2) for c in contexts):
        for b in batches:
            for i in range(b):
                prompt = [(13 * i + j) % vocab for j in range(context)]
                engine.add_request(prompt, params(decode_steps + 1))
            while any(not r.started for r in engine.requests.values()):
                engine.step()  # the prompts
            for k in range(decode_steps):
                steps.append((StepTerms(0, b, b * (context + 2 + k), 0), timed_step()))
            while engine.has_unfinished():
                engine.step()
    return steps


def fit_steps(steps: list[Step], base: CostModel, note: str) -> CostModel:
    """base's compute fitted to an engine's steps: overhead + prompt tokens + decoding requests +
    KV tokens attended + prompt pairs, least squares on the relative error. A step that took more
    than IDLE_FACTOR times the fit's time was followed by a wait (a workload's gap between
    arrivals): left out, and the fit made again."""
    fit = with_coefficients(base, least_squares(steps))
    for _ in range(2):
        kept = busy(steps, fit)
        fit = with_coefficients(base, least_squares(kept))
    note = f"least squares over {len(kept)} of {len(steps)} measured steps: {note}"
    return replace(fit, notes=[note])


def busy(steps: list[Step], fit: CostModel) -> list[Step]:
    """The steps not followed by a wait for arrivals: those within IDLE_FACTOR of the fit."""
    return [(terms, t) for terms, t in steps if t <= IDLE_FACTOR * fit.step_time(terms)]


def least_squares(steps: list[Step]) -> list[float]:
    """The coefficients of 1 and each StepTerms field that fit the steps' relative times."""
    x = torch.tensor([[1.0, *terms] for terms, _ in steps], dtype=torch.float64)
    y = torch.tensor([t for _, t in steps], dtype=torch.float64)
    ones = torch.ones(len(steps), 1, dtype=torch.float64)
    return torch.linalg.lstsq(x / y[:, None], ones).solution.clamp(min=0).flatten().tolist()


def with_coefficients(base: CostModel, fit: list[float]) -> CostModel:
    return replace(
        base,
        weights_read_s=0.0,
        per_kv_token_s=0.0,
        overhead_s=fit[0],
        per_prefill_token_s=fit[1],
        per_decode_seq_s=fit[2],
        per_attended_token_s=fit[3],
        per_prompt_pair_s=fit[4],
    )


def engine_base(engine) -> CostModel:
    """The cpu-smollm2 form with this engine's model and KV sizes: its compute still to fit."""
    return replace(
        cpu_smollm2(),
        name="calibrated",
        model=engine.config,
        kv_bytes_per_token=engine.kv.bytes_per_block // engine.kv.block_size,
        num_kv_blocks=engine.kv.num_blocks,
    )


def calibrate(llm) -> CostModel:
    """A cost model of this engine from its steps here (bench.py --calibrate)."""
    return fit_steps(calibration_steps(llm), engine_base(llm.engine), "this engine's calibration")
