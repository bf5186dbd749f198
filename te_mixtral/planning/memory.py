"""How much memory one training step needs on each rank, from the config alone.

Shape legend: B samples and T tokens on this rank in one forward (one micro-batch), S
sequence length, D model dim, H query heads, G key/value heads, Hd head dim, V vocabulary,
E experts in the model, K top-k, F expert hidden dim, R rows routed to this rank's experts.

Nothing is allocated: the bytes are counted from the shapes, so `--estimate-memory` answers
in a second for a model that could never be built here, and a run that cannot fit refuses
before it starts (instead of being killed by the kernel, or by CUDA, minutes later).

What is counted. A step holds the parameters, their gradients and the optimizer state, and
between forward and backward whatever the forward saved for the backward: per decoder layer

    norms         each RMSNorm's input (TE: cast to the compute dtype; PyTorch: the input in
                  fp32 and the normalised output in the residual dtype)
    linear inputs the normalised rows the q/k/v projections and the router read (PyTorch
                  under autocast from an fp32 residual: each of the four casts its own copy)
    attention     q, k, v and the output, plus the softmax statistics (fp32, T x H); the
                  PyTorch backend's SDPA also keeps its [B, 1, S, S] document mask
    routing       router probabilities (fp32, T x E), top-k indices and weights
    dispatch      the R = T*K dispatched rows (R x D), the expert tier's input
    experts       what the expert tier says it keeps (`ExpertTier.memory`, in bytes): autograd's
                  hidden rows, gate_up output (R x 2F), silu(gate) and the SwiGLU output (R x F
                  each), or less where a tier fuses them; a tier's own weight copies (FP8, say)
    combine       the expert outputs for the routing-weighted sum: in fp32 (R x D x 4) on
                  PyTorch, as they are on TE (its fused unpermute)

Activation recompute (`train.recompute`, te_mixtral/model/recompute.py) changes what a layer
keeps: selective drops the expert FFN's hidden rows and the experts' weight copies (the tier
runs again in the backward); full keeps only each layer's input. Either way the layer whose
backward runs holds all of it again while it does. With `train.recompute_layers` only the
first N layers do so, the others keep what `none` keeps; `fewest_recomputed_layers` finds the
smallest N that fits, which `--estimate-memory` and a refusal name.

And, once per step, the rotary tables, the final norm, the LM head's input, the router
statistics and the log-probabilities in fp32 (T x V x 4: a large one; TE's fused cross-entropy,
`--te_fusions`, keeps the logits' fp32 gradient instead, as large). With fp32 parameters under
bf16 autocast every matrix a GEMM reads is also cast to bf16 and that copy is saved until its
layer's backward ("weight copies", 2 bytes per matrix parameter), but q, k and v's when the TE
backend packs them (te_mixtral/model/packed_projection.py keeps the parameters, not a copy).

LoRA (`lora.rank` > 0): the base is frozen in the compute dtype, with no gradient and no
optimizer state; the adapters are fp32 with fp32 gradients and AdamW moments. Activations
are counted as a full fine-tune's plus each adapter's rank-r product: an upper bound, since
a frozen weight's GEMM keeps no input for its own gradient (tests/measure/test_memory_lora.py
measures how far above). A tier may hold the frozen experts its own way (device_mxfp8 on
Hopper: FP8 alone, a byte per element and a scale per row; `ExpertTier.memory` says so).

Under `train.sharding: fsdp` a rank keeps shards of the weights, their gradients and the
optimizer state, and FSDP holds some of them whole for a while (model_state.py, `held_fsdp`).

Under expert parallelism every rank receives T*K rows on average; routing is assumed balanced
and `ROUTING_IMBALANCE` is the margin kept for the busiest rank in one layer,
`margin_over_layers` for what the layers keep together (their busiest ranks differ). The
counts follow what the code of this package saves (checked tensor by tensor with
`saved_tensors_hooks`, on the CPU in tests/measure/test_memory.py and on an H100 for the TE
path).

When the peak comes. Not at the end of the forward: the step's memory peaks at one of

    head backward     every layer's activations and weight copies are held, the fp32
                      log-probabilities meet their gradient and the logits' (2 x T x V x 4;
                      TE's fused cross-entropy: its fp32 gradient meets a bf16 copy, T x V x 2)
    layer 0 backward  all gradients but the embedding's exist, one layer's activations and
                      copies remain, and the expert backward's gradient rows are in flight
    optimizer step    parameters, gradients and state together

The bf16 logits stay referenced by the training loop through the whole step, so every phase
counts them. The estimate is the largest phase, and predicts `torch.cuda.max_memory_allocated`;
`fits` adds what that number leaves out (CUDA context, allocator slack).

Gradient accumulation (`train.grad_accum_steps` N). Activations belong to one forward, so
they are counted for one micro-batch: B = batch_size / (world x N). The gradients are a
buffer that lives through the whole step: from the second micro-batch on, the head backward
and the layer 0 backward find every gradient there already. (The loop lets the previous
micro-batch's logits go when the next forward returns, before its head backward.)
"""

import importlib.util
import math
from dataclasses import dataclass, replace

from te_mixtral.config import (
    RECOMPUTE,
    RunConfig,
    recomputed_layers,
)
from te_mixtral.config_checks import validate_model
from te_mixtral.distributed.launcher_env import main_rank_from_env
from te_mixtral.errors import UserError
from te_mixtral.experts.base import ExpertLoad
from te_mixtral.experts.registry import BASELINES, check_tier_model, expert_memory, lighter_settings
from te_mixtral.files import size_text
from te_mixtral.measure.capacity import GiB, capacity
from te_mixtral.measure.model_state import (
    ParamCounts,
    count_adapters,
    count_parameters,
    held_fsdp,
    held_unsharded,
    local_parts,
)
from te_mixtral.measure.report import format_table

# (parameter, gradient, optimizer state) bytes per parameter. adamw_fp32: fp32 weights,
# gradients and two fp32 moments. The master modes keep bf16 weights and gradients and carry
# the bits bf16 rounding drops in an int16 remainder (counted as state), beside bf16 or fp32
# moments.
OPTIMIZERS = {
    "adamw_fp32": (4, 4, 8),
    "master_bf16": (2, 2, 2 + 4),
    "master_fp32_moments": (2, 2, 2 + 8),
}
# The experts' state under `train.expert_moments: 8bit` (te_mixtral/optim/moments8.py): the
# remainder, a byte for each moment, and an fp32 scale per block of 256 values for each.
EXPERT_STATE_8BIT = 2 + 2 * (1 + 4 / 256)
# Under expert parallelism the busiest rank receives more than the average T*K rows: up to
# 1.46 times in this project's EP runs (expert_rows_per_rank in docs/results/*/runs, one step
# each; the peak is over all steps). That is one layer's margin, and the margin of what two
# layers keep together (the 2-layer runs, whose peaks need it). What more layers keep adds up
# over layers whose busiest ranks differ, so the excess shrinks as for independent layers,
# with the square root of their number (`margin_over_layers`): summed over the layers, the
# fullest rank's rows were at most 1.10 times the mean at 16 layers (the margin: 1.18) and
# 1.06 at 32 (1.13), tokens_per_expert in those runs' results.json.
ROUTING_IMBALANCE = 1.5


def margin_over_layers(layers: int) -> float:
    """The busiest rank's share of the rows that `layers` layers keep together, over the mean."""
    return 1 + (ROUTING_IMBALANCE - 1) * min(1.0, math.sqrt(2 / max(layers, 1)))


# GEMM libraries' workspaces on a GPU (cuBLAS, cuBLASLt, TE), handed out by PyTorch's allocator.
WORKSPACE_BYTES = 256 * 2**20
# What max_memory_allocated leaves out but a GPU must also hold: the CUDA context and library
# handles outside PyTorch's allocator, and the allocator's partly used blocks. (On the CPU
# the check compares with MemAvailable read after torch is loaded: only the slack applies.)
CUDA_CONTEXT_BYTES = 1 * GiB
ALLOCATOR_SLACK = 0.05

PARTS = ("parameters", "gradients", "optimizer state", "weight copies", "activations", "workspace, transients")


@dataclass
class MemoryEstimate:
    """Per-rank bytes of each part at each phase of a step; the peak is the largest phase."""

    phases: dict[str, dict[str, int]]  # phase -> part (PARTS) -> bytes
    forward_saved: int  # what one forward saves for the backward (activations and weight copies)
    params: ParamCounts
    local_params: int  # what this rank holds of them: all, or its shards under fsdp
    device: str  # "cuda" or "cpu": what the estimate was made for
    describe: str  # the layout in words, for the table's title

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    @property
    def total(self) -> int:
        return sum(self.phases[self.peak_phase].values())

    def part(self, name: str) -> int:
        """One part's bytes at the peak."""
        return self.phases[self.peak_phase][name]

    @property
    def parameters(self) -> int:
        return self.part("parameters")

    @property
    def gradients(self) -> int:
        """All gradients, as they stand after the backward."""
        return self.phases["optimizer step"]["gradients"]

    @property
    def optimizer_state(self) -> int:
        return self.part("optimizer state")

    @property
    def activations(self) -> int:
        return self.part("activations")

    @property
    def workspace(self) -> int:
        return self.part("workspace, transients")

    def required(self) -> int:
        """Device memory needed: the peak plus what the allocator's count leaves out."""
        return int(self.total * (1 + ALLOCATOR_SLACK)) + (CUDA_CONTEXT_BYTES if self.device == "cuda" else 0)

    def fits(self, capacity_bytes: int) -> bool:
        return self.required() <= capacity_bytes

    def table(self, capacity_bytes: int | None = None, capacity_name: str = "") -> str:
        """The parts at each phase in GiB (MiB for a small model), the peak, and whether it fits."""
        unit, scale = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        names = list(self.phases)
        rows = [(part, *(f"{self.phases[n][part] / scale:.2f}" for n in names)) for part in PARTS]
        rows.append(("total", *(f"{sum(self.phases[n].values()) / scale:.2f}" for n in names)))
        lines = [f"memory per rank: {self.describe}; {self.local_params / 1e6:,.1f} M parameters on this rank",
                 format_table(rows, header=(unit, *names)),
                 f"peak {self.total / scale:.2f} {unit} in the {self.peak_phase}"]
        if capacity_bytes is not None:
            verdict = "fits" if self.fits(capacity_bytes) else "does NOT fit"
            extra = "the CUDA context and allocator slack" if self.device == "cuda" else "allocator slack"
            lines.append(f"{verdict} {capacity_name} ({size_text(capacity_bytes)}): needs {size_text(self.required())} "
                         f"with {extra}")
        return "\n".join(lines)


def _backend(cfg: RunConfig, device: str) -> str:
    """The layer backend `resolve_backend` will pick, decided without importing TE. Planning a
    GPU run from a machine without one assumes the GPU machine has TE."""
    if cfg.backend != "auto" or device != "cuda":
        return "torch" if cfg.backend == "auto" else cfg.backend
    import torch

    planning = not torch.cuda.is_available()
    return "te" if planning or importlib.util.find_spec("transformer_engine") else "torch"


def optimizer_mode(cfg: RunConfig) -> str:
    """The `OPTIMIZERS` row of the run's `train.optimizer` and `train.moment_dtype`."""
    if cfg.train.optimizer == "adamw":
        return "adamw_fp32"
    return "master_bf16" if cfg.train.moment_dtype == "bf16" else "master_fp32_moments"


def state_bytes(cfg: RunConfig, expert: bool, optimizer: str | None = None) -> float:
    """Optimizer state per parameter, of an expert weight or another, for the run's optimizer
    (or the `OPTIMIZERS` mode `optimizer`)."""
    optimizer = optimizer or optimizer_mode(cfg)
    if expert and optimizer != "adamw_fp32" and cfg.train.expert_moments == "8bit":
        return EXPERT_STATE_8BIT
    return OPTIMIZERS[optimizer][2]


def estimate_memory(cfg: RunConfig, world_size: int, *, optimizer: str | None = None, recompute: str | None = None,
                    fsdp: bool | None = None, device: str | None = None) -> MemoryEstimate:
    """Bytes per rank for `cfg` launched on `world_size` ranks (see the module docstring).

    `optimizer`, `recompute` and `fsdp` default to the run's (`train.optimizer`,
    `train.recompute`, `train.sharding == "fsdp"`; see te_mixtral/model/recompute.py for the
    modes). With fsdp on several ranks, weights, gradients and optimizer state are held as
    `held_fsdp` says. `device` defaults to the config's resolved device.
    """
    optimizer = optimizer or optimizer_mode(cfg)
    recompute = recompute or cfg.train.recompute
    if fsdp is None:
        fsdp = cfg.train.sharding == "fsdp"
    if optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer mode '{optimizer}' (modes: {', '.join(OPTIMIZERS)})")
    if recompute not in RECOMPUTE:
        raise UserError(f"unknown recompute mode '{recompute}' (modes: {', '.join(RECOMPUTE)})")
    m, ep = cfg.model, cfg.ep_size
    device = device or cfg.resolved_device()
    precision = cfg.train.dtype if cfg.train.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    backend = "torch" if cfg.tier in BASELINES else _backend(cfg, device)
    p_bytes, g_bytes, s_bytes = OPTIMIZERS[optimizer]
    lora = cfg.lora
    if lora.enabled:  # the base frozen in the compute dtype, no gradient or state; the adapters' below
        p_bytes, g_bytes, s_bytes = (2 if precision == "bf16" else 4), 0, 0
    a = 2 if precision == "bf16" or p_bytes == 2 else 4  # compute dtype
    r = p_bytes  # residual stream: the embedding's dtype, fp32 + bf16 stays fp32
    copy = 2 if a == 2 and p_bytes == 4 else 0  # autocast's bf16 copy of an fp32 matrix

    params = count_parameters(m, ep)
    accumulating = cfg.train.grad_accum_steps > 1
    batch = cfg.train.batch_size // (world_size * cfg.train.grad_accum_steps)  # one micro-batch
    S, D, V = cfg.data.seq_len, m.hidden_size, m.vocab_size
    E, K = m.num_experts, m.num_experts_per_tok
    H, G, Hd = m.num_attention_heads, m.num_key_value_heads, m.head_dim
    T = batch * S

    def rows(margin: float) -> int:  # the busiest rank's rows (ROUTING_IMBALANCE*)
        return round(T * K * (margin if ep > 1 else 1))

    # What the expert FFN holds per layer, in bytes: the tier's own to say (ExpertTier.memory).
    def expert_memory_of(R: int):
        return expert_memory(cfg, ExpertLoad(device, R, E // ep, activation_bytes=a, weight_bytes=p_bytes))

    # A PyTorch norm keeps its input in fp32 (the input itself from an fp32 residual, a copy
    # from a bf16 one) and the normalised rows in the residual dtype.
    norm = (a * T * D if backend == "te" else (4 + r) * T * D) + 4 * T
    # The rows q/k/v and the router read: one tensor per norm, unless autocast casts the
    # PyTorch norm's fp32 output, once for each of the four linears (TE's norm emits bf16).
    linear_inputs = (4 if backend == "torch" and r != a else 2) * a * T * D
    mask = a * batch * S * S if backend == "torch" else 0
    # The combine keeps the expert output rows for its backward: TE's unpermute as they are,
    # PyTorch's weighted sum an fp32 copy (distributed/dispatch.py); so is its gradient made.
    combine = a if backend == "te" else 4

    def layer_saved(R: int, tier) -> tuple[int, int]:
        """(the dense part, the expert FFN's hidden rows) a layer keeps for its backward."""
        dense_layer = (2 * norm + linear_inputs
                       + a * T * Hd * (2 * H + 2 * G) + 4 * T * H + mask  # attention
                       + 4 * T * E + 32 * T * K + 4 * T  # routing: probs; indices and weights
                       + a * R * D + combine * R * D)  # dispatched rows; combine
        # LoRA: each adapter keeps its rank-r product of the rows it reads (its input is kept
        # anyway) for B's gradient: per row of its layer, T for attention's, R for the experts'.
        dense_layer += a * lora.rank * T * len(lora.dense_targets())
        return dense_layer, tier.hidden + a * lora.rank * R * len(lora.expert_targets())

    # One layer at a time (its backward) takes one layer's margin; the layers held together
    # until the head's backward take the margin over layers.
    R = rows(ROUTING_IMBALANCE)
    tier = expert_memory_of(R)
    dense_layer, expert_hidden = layer_saved(R, tier)
    R_held = rows(margin_over_layers(m.num_hidden_layers))
    dense_held, expert_hidden_held = layer_saved(R_held, expert_memory_of(R_held))
    fused = backend == "te" and cfg.te_fusions  # model/layers.py: q, k and v packed; TE's cross-entropy
    packed_qkv = D * Hd * (H + 2 * G) if fused else 0
    dense_copies, expert_copies = copy * (params.dense_per_layer - 2 * D - packed_qkv), copy * params.experts_per_layer
    layer_copies = dense_copies + expert_copies + tier.weight_copies
    # What a layer keeps until its backward: selective recomputes the expert FFN, and with it
    # the experts' weight copies; full keeps the layer's input alone.
    cached = tier.weight_copies_cached
    saved = {"none": (dense_held + expert_hidden_held, dense_copies + expert_copies + tier.weight_copies_saved),
             "selective": (dense_held, dense_copies + cached),
             "full": (r * T * D, cached)}
    recomputing = recomputed_layers(replace(cfg.train, recompute=recompute), m.num_hidden_layers)
    kept = m.num_hidden_layers - recomputing  # layers that keep what `none` keeps
    layers_saved = recomputing * saved[recompute][0] + kept * saved["none"][0]
    layers_copies = recomputing * saved[recompute][1] + kept * saved["none"][1]
    head = norm + a * T * D + 4 * T * V + 8 * T + 2 * 4 * batch * S * Hd  # + ids, rotary tables
    head += m.num_hidden_layers * (12 * E + 4)  # router statistics: picks (int64), prob sums, z sum
    if recompute == "full":
        head += 8 * T  # the position ids, which every recomputed attention reads again
    logits = a * T * V  # referenced by the training loop until the next step
    head_copy = copy * V * D

    # The expert backward in flight: gradients of its input and output rows, the gradient of
    # the weighted combine, and what the tier's backward holds (ExpertMemory.hidden_grad).
    expert_bwd = R * (2 * a * D + combine * D) + tier.hidden_grad
    one_layer = dense_layer + expert_hidden  # a recomputed layer saves as much as a kept one

    sharded = fsdp and world_size > 1
    whole_until_last = accumulating and cfg.train.fsdp_reduce == "step"
    held = (held_fsdp(params, world_size // ep, world_size, p_bytes, g_bytes, accumulating, whole_until_last)
            if sharded
            else held_unsharded(params, p_bytes, g_bytes, accumulating, m.tie_word_embeddings))
    if tier.weights_saved:  # the tier holds the experts in less than the parameters' dtype
        saved_weights = m.num_hidden_layers * tier.weights_saved
        held = {name: (weights - saved_weights, grads, flight) for name, (weights, grads, flight) in held.items()}
    local_dense, local_experts = (local_parts(params, world_size // ep, world_size) if sharded
                                  else (params.dense, params.experts))
    local = local_dense + local_experts
    state = 0 if lora.enabled else round(s_bytes * local_dense + state_bytes(cfg, True, optimizer) * local_experts)
    L = m.num_hidden_layers

    workspace = WORKSPACE_BYTES if device == "cuda" else 0
    # LoRA's adapters: fp32 weights, gradients and AdamW moments, a bf16 copy under autocast.
    adapters = count_adapters(m, ep, lora)
    adapter_grads = {"head backward": 4 * adapters if accumulating else 0}

    def phase(name, copies, activations, transient):
        weights, gradients, in_flight = held[name]
        return dict(zip(PARTS, (weights + 4 * adapters, gradients + adapter_grads.get(name, 4 * adapters),
                                state + 8 * adapters, copies + (2 * adapters if a == 2 else 0), activations,
                                workspace + transient + in_flight)))

    phases = {
        "head backward": phase("head backward", layers_copies + head_copy, layers_saved + head + logits,
                               (2 if fused else 2 * 4) * T * V),
        # A tier's cached weight copies stay in every layer through the backward and the step.
        "layer 0 backward": phase("layer 0 backward", layer_copies + (L - 1) * cached, one_layer + logits,
                                  expert_bwd),
        "optimizer step": phase("optimizer step", L * cached, logits, 0),
    }
    micro = f" per micro-batch, {cfg.train.grad_accum_steps} micro-batches" if accumulating else ""
    base = f"{'bf16' if p_bytes == 2 else 'fp32'} base{f', {tier.holds}' if tier.holds else ''}"
    eight_bit = ", experts' moments 8-bit" if state_bytes(cfg, True, optimizer) == EXPERT_STATE_8BIT else ""
    trains = (f"LoRA r={lora.rank} on a frozen {base} "
              f"({adapters / 1e6:,.1f} M adapter parameters)" if lora.enabled else optimizer + eight_bit)
    describe = (f"world {world_size}, EP {ep}, {T} tokens ({batch} x {S}){micro}, {E // ep} of {E} experts, "
                f"{cfg.tier} on {backend} {'bf16' if a == 2 else 'fp32'}, {trains}, recompute {recompute}"
                + (f" in {recomputing} of {m.num_hidden_layers} layers" if kept and recomputing else "")
                + (f", sharded by fsdp ({params.total / 1e6:,.1f} M parameters unsharded)" if sharded else ""))
    return MemoryEstimate(phases, layers_saved + layers_copies + head + head_copy, params, local, device,
                          describe)


def _lighter(cfg: RunConfig, device: str) -> list[tuple[str, dict, dict]]:
    """(command-line setting, train overrides, run overrides) for each setting that holds less
    than the run's own, at some cost in time; recompute from the least to the most."""
    t = cfg.train
    lighter = [(f"--recompute {mode}", {"recompute": mode}, {})  # RECOMPUTE goes from most kept to least
               for mode in RECOMPUTE[RECOMPUTE.index(t.recompute) + 1:] if cfg.tier not in BASELINES]
    if t.optimizer == "adamw" and device == "cuda":  # master_adamw keeps bf16 parameters: GPU runs only
        lighter.append(("--optimizer master_adamw --dtype bf16", {"optimizer": "master_adamw", "dtype": "bf16"}, {}))
    if t.optimizer == "master_adamw" and t.expert_moments == "same":
        lighter.append(("--expert_moments 8bit", {"expert_moments": "8bit"}, {}))
    lighter += [(setting, {}, run) for setting, run in lighter_settings(cfg)]
    if t.sharding == "fsdp" and t.grad_accum_steps > 1 and t.fsdp_reduce == "step":
        lighter.append(("--fsdp_reduce micro_batch", {"fsdp_reduce": "micro_batch"}, {}))
    return lighter


def _would_fit(cfg: RunConfig, world_size: int, device: str, limit: int) -> str:
    """Which of `_lighter`'s settings would each make the run fit ('--x (N GiB) or --y (M
    GiB) would fit'); else whether all of them together would (the most recompute); or ''."""
    def required(train: dict, run: dict) -> int | None:
        estimate = estimate_memory(replace(cfg, train=replace(cfg.train, **train), **run), world_size, device=device)
        return estimate.required() if estimate.fits(limit) else None

    def fitting(setting: str, train: dict, run: dict) -> str | None:
        """'setting (N GiB)' if it fits; a recompute setting with the fewest layers that fit."""
        if (need := required(train, run)) is None:
            return None
        if "recompute" in train:
            setting_cfg = replace(cfg, train=replace(cfg.train, **train), **run)
            if layers := fewest_recomputed_layers(setting_cfg, world_size, device, limit):  # 0: none fits, not here
                setting = f"{setting} --recompute_layers {layers}"
                need = required({**train, "recompute_layers": layers}, run)
        return f"{setting} ({size_text(need)})"

    options = _lighter(cfg, device)
    alone = [text for option in options if (text := fitting(*option)) is not None]
    if alone:
        return f"alone, {' or '.join(alone)} would fit"
    recomputes = [option for option in options if "recompute" in option[1]]
    together = recomputes[-1:] + [option for option in options if "recompute" not in option[1]]
    if len(together) > 1:
        train = {key: value for _, overrides, _ in together for key, value in overrides.items()}
        run = {key: value for _, _, overrides in together for key, value in overrides.items()}
        if (need := required(train, run)) is not None:
            return f"together, {' '.join(setting for setting, _, _ in together)} would fit ({size_text(need)})"
    return ""


def fewest_recomputed_layers(cfg: RunConfig, world_size: int, device: str, limit: int) -> int | None:
    """The fewest layers that may recompute (cfg's mode) with the run still fitting `limit`,
    0 if none need to, when fewer than the run's own would; else None. A layer that keeps its
    activations skips the recompute's extra forward: the estimate decides how many can."""
    recomputing = recomputed_layers(cfg.train, cfg.model.num_hidden_layers)
    for layers in range(recomputing):
        if estimate_memory(recomputing_only(cfg, layers), world_size, device=device).fits(limit):
            return layers
    return None


def recomputing_only(cfg: RunConfig, layers: int) -> RunConfig:
    """`cfg` with its recompute mode in its first `layers` layers alone (0: recompute none)."""
    train = {"recompute": "none", "recompute_layers": None} if layers == 0 else {"recompute_layers": layers}
    return replace(cfg, train=replace(cfg.train, **train))


def check_fits(cfg: RunConfig, world_size: int, device: str, **options) -> MemoryEstimate:
    """Refuse, with the table, a run whose estimate exceeds what one rank may use; else say
    the estimate in one line, to read beside the measured peak. `options` go to
    `estimate_memory` (optimizer, recompute, fsdp)."""
    estimate = estimate_memory(cfg, world_size, device=device, **options)
    limit, name = capacity(cfg, device)
    if limit is not None and not estimate.fits(limit):
        if main_rank_from_env():
            print(estimate.table(limit, name), flush=True)
        raise UserError(f"this run needs about {size_text(estimate.required())} per rank but {name} has "
                        f"{size_text(limit)} (the table above breaks it down; fewer layers, a smaller batch, "
                        f"more micro-batches (train.grad_accum_steps) or more EP ranks would help)"
                        + (f"; {hint}" if not options and (hint := _would_fit(cfg, world_size, device, limit)) else ""))
    if main_rank_from_env():
        room = f" of {size_text(limit)} on {name}" if limit is not None else ""
        print(f"memory estimate: peak {size_text(estimate.total)} per rank, {size_text(estimate.required())} "
              f"needed{room} (--estimate-memory prints the table)", flush=True)
    return estimate


def print_estimate(cfg: RunConfig, world_size: int) -> int:
    """`--estimate-memory`: print the table for the config and layout; build nothing."""
    if cfg.model_path is not None:  # the checkpoint's config.json replaces `model`; its weights are not read
        from te_mixtral.model.hf_config import longest_sequence, model_config_from_hf, resolve_model_path

        cfg = replace(cfg, model=model_config_from_hf(resolve_model_path(cfg.model_path, ("config.json",)),
                                                      longest_sequence(cfg)))
        validate_model(cfg)
        check_tier_model(cfg)
    # --gpu names a GPU: estimate a GPU run even from a machine without one.
    device = "cuda" if cfg.gpu is not None and cfg.device != "cpu" else cfg.resolved_device()
    estimate = estimate_memory(cfg, world_size, device=device)
    limit, name = capacity(cfg, device)
    if main_rank_from_env():
        print(estimate.table(limit, name), flush=True)
        if limit is not None and not estimate.fits(limit) and (hint := _would_fit(cfg, world_size, device, limit)):
            print(hint[0].upper() + hint[1:], flush=True)
        elif limit is not None and (layers := fewest_recomputed_layers(cfg, world_size, device, limit)) is not None:
            need = size_text(estimate_memory(recomputing_only(cfg, layers), world_size, device=device).required())
            print(f"No layer needs recompute here: --recompute none fits too ({need}) and runs no second forward"
                  if layers == 0 else
                  f"Fewer layers need recompute: --recompute_layers {layers} of {cfg.model.num_hidden_layers} fits "
                  f"too ({need}), and the others run no second forward", flush=True)
    return 0
