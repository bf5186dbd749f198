"""What a training step costs, how long it took, and how close it came to the hardware.

Model FLOPs. A Mixtral token only touches the parameters on its path: the attention
projections, the router, its top-k experts (not all E), and the LM head. Per layer, with
D model dim, H query heads, Hkv key/value heads, hd head dim, E experts, K top-k and
F expert hidden dim:

    attention   q: D*H*hd   k: D*Hkv*hd   v: D*Hkv*hd   o: H*hd*D
    router      D*E                      (every token scores every expert)
    experts     K * 3*D*F                (gate, up, down of each chosen expert)
    norms       2*D                      (negligible, counted for completeness)

plus a final norm D and the LM head V*D. The embedding is a table lookup, not a matmul, so
it is left out; a tied LM head still costs its V*D matmul and is counted. A matmul costs 2
FLOPs per parameter per token forward and 4 backward (gradients for input and weight), so
a training step costs

    6 * active_params_per_token * tokens
  + 3 * layers * 4*H*hd * causal_pairs

where the second line is attention's own matmuls: forward, QK^T and AV each cost 2*H*hd
FLOPs per (query, key) pair, and a causal document of length L has L*(L+1)/2 pairs. Packed
documents attend only within themselves, so pairs are summed per document, not over the
whole packed row. These are *model* FLOPs: recomputation, padding and the MoE's permutes
and all-to-alls do not count, so MFU measures useful work.

MFU = achieved model FLOP/s per GPU / the GPU's dense BF16 peak. Peaks are the dense (not
2:4-sparse) tensor-core numbers from vendor datasheets; an fp32 run is measured against the
BF16 peak too, which is the honest ceiling for a training recipe, not for fp32 math.

Timing. CUDA kernels run asynchronously: a host clock read right after launching a step
measures launch time, not compute. `StepTimer` synchronises before each clock read. The
first steps pay for allocator growth, autotuning and lazy initialisation, so `summarize`
leaves out `timing_warmup_steps` and reports the median step, which one slow step (a
checkpoint, a stray collective hiccup) does not move.
"""

import math
import resource
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from te_mixtral.config import LoRAConfig, ModelConfig
from te_mixtral.distributed.layout import Layout, all_reduce_max
from te_mixtral.measure.model_state import adapter_widths

# Dense BF16 tensor-core peak FLOP/s per GPU, matched against the CUDA device name
# (e.g. "NVIDIA H100 80GB HBM3"). First match wins, so a name that contains another must
# come before it: "H100 PCIe" before "H100", "GB200" before "B200". GH200 matches "H200",
# which is right: same Hopper die and clock. A None entry is a variant whose peak we do not
# list but which would otherwise fall through to a wrong row: n/a beats a wrong MFU.
PEAK_BF16_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", None),  # lower clocks than SXM; published figures have changed over time
    ("H100", 989.4e12),  # SXM5 / HBM3
    ("H200", 989.4e12),
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("A100", 312e12),  # SXM4 and PCIe have the same tensor-core peak
    ("L40S", 362e12),
)

GIB = 2**30


def peak_flops(device_name: str) -> float | None:
    """Dense BF16 peak FLOP/s for a device name; None for CPUs and GPUs not in the table."""
    lowered = device_name.lower()
    for pattern, flops in PEAK_BF16_FLOPS:
        if pattern.lower() in lowered:
            return flops
    return None


def active_params_per_token(m: ModelConfig) -> int:
    """Parameters whose matmuls one token passes through (see the module docstring)."""
    D, H, Hkv, hd = m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim
    attention = D * H * hd + 2 * D * Hkv * hd + H * hd * D
    router = D * m.num_experts
    experts = m.num_experts_per_tok * 3 * D * m.intermediate_size
    norms = 2 * D
    per_layer = attention + router + experts + norms
    return m.num_hidden_layers * per_layer + D + m.vocab_size * D


def causal_pairs(cu_seqlens: torch.Tensor) -> int:
    """Number of (query, key) pairs causal attention scores over packed documents."""
    # int64 on purpose: cu_seqlens is int32, and one 64k-token document alone has 2e9 pairs.
    lengths = cu_seqlens.to(torch.int64).diff()
    return int((lengths * (lengths + 1) // 2).sum())


def adapter_params_per_token(m: ModelConfig, lora: LoRAConfig) -> int:
    """LoRA's adapter parameters one token passes through: r * (in + out) per adapted dense
    projection, and per adapted expert weight for each of its top-k experts."""
    dense, expert = adapter_widths(m, lora)
    return m.num_hidden_layers * lora.rank * (dense + m.num_experts_per_tok * expert)


def train_flops(m: ModelConfig, cu_seqlens: torch.Tensor, num_tokens: int, lora: LoRAConfig | None = None) -> float:
    """Model FLOPs of one training step (forward + backward) over one batch:

        6 * active_params_per_token(m) * num_tokens
      + 12 * num_hidden_layers * num_attention_heads * head_dim * sum_docs L*(L+1)/2

    `cu_seqlens` holds the cumulative document lengths over the batch's flattened tokens
    (`[0, L_0, L_0 + L_1, ...]`). Pass the CPU copy: reading a CUDA tensor here would force
    a device sync in the middle of the timed step. For a step over several ranks, sum the
    ranks' values: that global number is what `summarize` expects.

    With LoRA (`lora.rank` > 0) only the FLOPs that run count: a frozen weight's GEMMs run
    forward and for the input's gradient, not for its own (4 FLOPs per parameter and token,
    not 6), and the adapters train (6 each). Layer 0's q, k and v projections get no input
    gradient either (the frozen embedding needs none); they are counted as if they did, a
    fraction of a percent of a step.
    """
    frozen = lora is not None and lora.enabled
    matmuls = (4 if frozen else 6) * active_params_per_token(m) * num_tokens
    if frozen:
        matmuls += 6 * adapter_params_per_token(m, lora) * num_tokens
    attention_forward = m.num_hidden_layers * 2 * (2 * m.num_attention_heads * m.head_dim) * causal_pairs(cu_seqlens)
    return float(matmuls + 3 * attention_forward)


class StepTimer:
    """Wall-clock time of each training step (or of any piece of work timed again and
    again, such as measure/phases.py's phases), with the GPU drained at both ends.

    Use `with timer.step(): ...` or `timer.start()` ... `seconds = timer.stop()`; every
    measured step is appended to `timer.times` (seconds), warm-up included: leaving the
    warm-up out is `summarize`'s job, so warm-up and timed steps share one code path.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.times: list[float] = []
        self._started: float | None = None

    def _now(self) -> float:
        # A synchronised host clock rather than CUDA events: events time one stream, but an
        # expert-parallel step also waits on NCCL streams and on the host (routing counts,
        # the optimizer), and the user pays for all of it. The sync costs microseconds
        # against a step of many milliseconds.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._started = self._now()

    def stop(self) -> float:
        if self._started is None:
            raise RuntimeError("StepTimer.stop() called without a matching start()")
        seconds = self._now() - self._started
        self._started = None
        self.times.append(seconds)
        return seconds

    @contextmanager
    def step(self):
        self.start()
        yield
        self.stop()


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process so far.

    On CUDA, the most the caching allocator handed to tensors on `device` (not what it
    reserved from the driver, which `nvidia-smi` shows and is larger). On CPU, the process's
    peak resident set size, which also counts Python, libraries and the data: compare CPU
    numbers with each other, not with GPU ones.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return max_rss if sys.platform == "darwin" else max_rss * 1024


def allocator_retries(device: torch.device | str) -> int:
    """How often the CUDA caching allocator found no free block and freed its whole cache to
    try again (0 on CPU). Each time it waits for the whole GPU (cudaFree), collectives of
    other ranks included: a run that does this is close to full, slower, and at risk of
    hanging with several GPUs."""
    device = torch.device(device)
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def by_rank(value: int, device: torch.device, layout: Layout) -> list[int]:
    """Every rank's `value`, in rank order; a collective: every rank calls it."""
    # Each rank's value in its own slot, so the maximum over the world gathers them all.
    slots = torch.zeros(layout.world_size, dtype=torch.int64, device=device)
    slots[layout.rank] = value
    return all_reduce_max(slots, layout).tolist()


def _p90(sorted_values: list[float]) -> float:
    # Nearest rank: the p90 is a step that really happened, not an interpolation.
    return sorted_values[math.ceil(0.9 * len(sorted_values)) - 1]


def summarize(
    step_times_s: list[float],
    timing_warmup_steps: int,
    tokens_per_step: int,
    world_size: int,
    flops_per_step: list[float] | float,
    peak_flops: float | None,
    peak_memory_bytes: int,
) -> dict:
    """Throughput statistics of a run, leaving out the first `timing_warmup_steps` steps.

    `tokens_per_step` and `flops_per_step` are global: summed over all ranks. A list of
    FLOPs is per step, aligned with `step_times_s`. Per-GPU figures divide by `world_size`.

    FLOP/s is the timed steps' mean FLOPs over the median step time. Steps differ in FLOPs
    only through attention (document lengths vary from batch to batch), which barely moves
    the step time; dividing the mean work by the same median time that gives tokens/s keeps
    MFU, tokens/s and step time telling one consistent story.

    Returns plain floats and ints (JSON-ready); `mfu` is None when the peak is unknown.
    """
    timed = step_times_s[timing_warmup_steps:]
    if not timed:
        raise ValueError(f"no timed steps: {len(step_times_s)} steps, {timing_warmup_steps} of them warm-up")
    if isinstance(flops_per_step, list):
        if len(flops_per_step) != len(step_times_s):
            raise ValueError(f"{len(flops_per_step)} FLOP counts for {len(step_times_s)} step times")
        flops = statistics.fmean(flops_per_step[timing_warmup_steps:])
    else:
        flops = float(flops_per_step)

    median_s = statistics.median(timed)
    tokens_per_s = tokens_per_step / median_s
    flops_per_s_per_gpu = flops / world_size / median_s
    return {
        "timed_steps": len(timed),
        "median_step_ms": median_s * 1e3,
        "p90_step_ms": _p90(sorted(timed)) * 1e3,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": tokens_per_s / world_size,
        "tflops_per_gpu": flops_per_s_per_gpu / 1e12,
        "mfu": None if peak_flops is None else flops_per_s_per_gpu / peak_flops,
        "peak_memory_gib": peak_memory_bytes / GIB,
    }


def device_name(device: torch.device) -> str:
    """The GPU's marketing name (what `peak_flops` looks up), or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
