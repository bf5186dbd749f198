"""Where a training step's time goes, phase by phase.

After the run (`--profile_phases true`), each phase of a step is timed on its own, forward
and backward, on the very inputs it received in the last step:

    attention  input norm + attention block (projections, RoPE, fused attention), all layers
    router     post-attention norm output -> logits -> softmax -> top-k weights
    dispatch   permute the token copies, all-to-all them to their experts' ranks
    experts    the expert tier on its sorted rows
    combine    all-to-all back, un-permute, weighted sum of each token's k outputs
    head       final norm + LM head + cross-entropy
    all-reduce with several ranks, unsharded: what the gradient sums add to a forward and
               backward (one with them minus one without); the overlap hides the rest
    all-gather instead, when FSDP shards the model (train.sharding fsdp): gathering
               every unit's weights once, as each forward does (and each backward again)
    clip       the global gradient norm, and scaling by it (MasterAdamW scales as it steps)
    optimizer  the AdamW step

With gradient accumulation a step runs the forward and backward phases once per
micro-batch and the rest once: the former are timed on the last micro-batch and counted
`train.grad_accum_steps` times, so that the phases still add up to a step.

With several ranks each phase reports its slowest rank: routing is rarely balanced, and the
rank with the most rows holds the others up at the next all-to-all. How unbalanced it was
is reported too: the rows each rank's experts received in the profiled step, all layers.

Pitfalls. A phase run alone loses the overlap of its launches with its neighbours', and the
allocator sees a different pattern, so the phases need not add up to the step time: the
table shows the step's median beside their sum. With several ranks the gradients are summed
inside the backward, overlapped with it: all-reduced in buckets (te_mixtral/distributed/
overlap.py), or reduce-scattered under FSDP, which also gathers the weights ahead of each
layer. The compute phases run with no communication (on gathered weights under FSDP). The
all-reduce phase is what the sums leave exposed; under FSDP the step's median minus the sum
of the phases is (plus the lost overlap of launches, as above). The optimizer
is stepped for real while it is timed, so this runs after everything else that reads the
weights.
"""

import statistics

import torch
from torch.distributed.fsdp import FSDPModule

from te_mixtral.distributed.layout import all_reduce_max
from te_mixtral.distributed.parallelize import gradient_reducer
from te_mixtral.measure.metrics import StepTimer


def _median_ms(fn, device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall time of `fn()` in milliseconds, after `warmup` untimed calls."""
    timer = StepTimer(device)
    for _ in range(warmup + repeats):
        with timer.step():
            fn()
    return statistics.median(timer.times[warmup:]) * 1e3


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def _forward_backward(model, fn, *inputs):
    """A closure running fn on fresh leaves of `inputs`, then its backward on a random gradient.

    Gradients are dropped first: in a step each weight's gradient is written once, not
    added to an existing one, and the extra read would inflate weight-heavy phases.
    """
    grad = {}

    def run():
        model.zero_grad(set_to_none=True)
        out = fn(*[_leaf(t) for t in inputs])
        if "out" not in grad:
            grad["out"] = torch.randn_like(out)
        out.backward(grad["out"])

    return run


def _capture_inputs(model, step_fn):
    """Run one step, keeping each layer's attention and MoE inputs."""
    captured = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            hooks.append(getattr(layer, name).register_forward_pre_hook(
                lambda module, args, key=(index, name): captured.__setitem__(key, args[0].detach())))
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda module, args: captured.__setitem__("final", args[0].detach())))
    step_fn()
    for hook in hooks:
        hook.remove()
    return captured


def _communicates(model, units: list, communicate: bool) -> None:
    """Off: no gradient sums after a backward, and every FSDP unit's weights gathered and
    kept so, so that the phases time compute alone. On: as in training again."""
    if (reducer := gradient_reducer(model)) is not None:
        reducer.sync = communicate
    for unit in units:
        unit.set_requires_gradient_sync(communicate, recurse=False)
        unit.set_reshard_after_backward(communicate, recurse=False)
        unit.set_reshard_after_forward(communicate and unit is not model, recurse=False)
        if communicate:
            unit.reshard()
        else:
            unit.unshard()


def profile_phases(model, clip, optimizer_step, step_fn, batch, num_targets, autocast, layout, cfg
                   ) -> tuple[dict, list[int]]:
    """Per-phase milliseconds (summed over layers) of one step, and each rank's expert rows
    in the last micro-batch. `clip()` clips the gradients as the loop does and returns what
    `optimizer_step(...)` takes (training/optimizer.py's `clip_gradients` and `optimizer_step`)."""
    device = next(model.parameters()).device
    captured = _capture_inputs(model, step_fn)
    reducer = gradient_reducer(model)
    if reducer is not None:
        reducer.finish()  # the sums that step's backward started, awaited as the loop does

    def ms(fn) -> float:
        return _median_ms(fn, device)

    # First, while the step's gradients are there. The optimizer really steps: that does not
    # change what it costs.
    update_ms = {}
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if units:
        update_ms["all-gather"] = ms(lambda: [unit.unshard() for unit in units] + [unit.reshard() for unit in units])
    if reducer is not None:
        def step(sync):
            def run():
                model.zero_grad(set_to_none=True)
                reducer.sync = sync
                step_fn()
                if sync:
                    reducer.finish()
            return run
        # Noise can make the difference of two medians negative where the overlap hid it all.
        update_ms["all-reduce"] = max(ms(step(True)) - ms(step(False)), 0.0)
    update_ms["clip"] = ms(clip)
    grad_scale = clip()
    update_ms["optimizer"] = ms(lambda: optimizer_step(grad_scale))
    packed = batch.packed
    rotary = model.model.rotary(packed)
    totals = dict.fromkeys(("attention", "router", "dispatch", "experts", "combine", "head"), 0.0)
    _communicates(model, units, False)
    expert_rows = 0
    with autocast:
        for index, layer in enumerate(model.model.layers):
            attn_in, moe_in = captured[(index, "input_layernorm")], captured[(index, "post_attention_layernorm")]
            totals["attention"] += ms(_forward_backward(model,
                lambda x: layer.self_attn(layer.input_layernorm(x), rotary, packed), attn_in))
            # The MoE block's own steps (MoEBlock.forward calls them in this order), each on
            # the previous step's output.
            mlp = layer.mlp
            x_TD = layer.post_attention_layernorm(moe_in).reshape(-1, moe_in.shape[-1]).detach()
            totals["router"] += ms(_forward_backward(model, lambda x: mlp.route(x)[0], x_TD))
            weights_TK, experts_TK = (t.detach() for t in mlp.route(x_TD)[:2])
            totals["dispatch"] += ms(_forward_backward(model,
                lambda x: mlp.dispatch(x, weights_TK, experts_TK).x_RD, x_TD))
            routed = mlp.dispatch(x_TD, weights_TK, experts_TK)
            expert_rows += routed.x_RD.shape[0]
            totals["experts"] += ms(_forward_backward(model,
                lambda x: mlp.run_experts(x, routed.tokens_per_expert_L), routed.x_RD))
            y_RD = mlp.run_experts(routed.x_RD, routed.tokens_per_expert_L)
            totals["combine"] += ms(_forward_backward(model, lambda y: mlp.combine(y, routed), y_RD))
        totals["head"] = ms(_forward_backward(model,
            lambda x: model.lm_loss(model.lm_head(model.model.norm(x)), batch.labels, num_targets),
            captured["final"]))
    # Forward and backward run once per micro-batch of a step; the update phases once.
    totals = {name: ms * cfg.train.grad_accum_steps for name, ms in totals.items()}
    totals.update(update_ms)
    _communicates(model, units, True)
    model.zero_grad(set_to_none=True)
    rows_per_rank = [expert_rows]
    if layout.world_size > 1:  # the slowest rank bounds the step (routing is rarely balanced)
        slowest = all_reduce_max(torch.tensor(list(totals.values()), dtype=torch.float64, device=device), layout)
        totals = dict(zip(totals, slowest.tolist()))
        gathered = torch.zeros(layout.world_size, dtype=torch.int64, device=device)
        torch.distributed.all_gather_into_tensor(gathered, torch.tensor([expert_rows], device=device))
        rows_per_rank = gathered.tolist()
    return totals, rows_per_rank
