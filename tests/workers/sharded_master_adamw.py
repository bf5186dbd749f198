"""torchrun worker (4 ranks): master_adamw on a model sharded by FSDP against the same model
unsharded, at EP=2 (x DP=2, bf16 moments, the experts' in 8 bits) and EP=4 (fp32 moments), in one
process group.

Usage: torchrun --nproc_per_node=4 tests/workers/sharded_master_adamw.py OUT_DIR

For each layout every rank builds the tiny bf16 model twice from one seed (A unsharded, B
sharded), then:
1. one forward and backward on its own tokens; A all-reduces its gradients as the loop does,
   B's FSDP reduce-scatters them. Both gradients are recorded (B's gathered whole).
2. two optimizer steps with gradient clipping: the first on A's reduced gradients (B gets
   its shard of them), the second on random gradients drawn alike on every rank; both
   models step with A's clip factor; both clip norms are recorded. A's and B's parameters,
   remainders and moments are recorded (B's gathered whole), with the elements B holds.
3. A and B are exported as Hugging Face checkpoints.
4. B is checkpointed, a third model C (another seed) resumes from it, and so does a fourth,
   D, unsharded (its experts read back from the slices FSDP cut); B, C and D take one more
   step on fresh random gradients: their states are recorded.
Writes OUT_DIR/ep{EP}/rank{r}.pt and OUT_DIR/ep{EP}/hf_{unsharded,sharded}/.
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from te_mixtral.config import load_config
from te_mixtral.data.tokenizer import Tokenizer, train_tokenizer
from te_mixtral.distributed.layout import (
    init_layout,
    is_expert_param,
    mesh_layout,
    shutdown,
)
from te_mixtral.distributed.parallelize import parallelize, reduce_gradients, shard_like
from te_mixtral.experts.loop import LoopTier
from te_mixtral.model.layers import TORCH, PackedSequences
from te_mixtral.model.mixtral import MixtralForCausalLM, causal_lm_loss, init_weights
from te_mixtral.training.checkpoint import Checkpointer, TrainState
from te_mixtral.training.hf_checkpoint import save_hf_checkpoint
from te_mixtral.training.optimizer import (
    clip_gradients,
    make_optimizer,
    optimizer_step,
    split_masters,
)

out_dir = Path(sys.argv[1])
MODEL = {"vocab_size": "64", "hidden_size": "16", "intermediate_size": "32", "num_hidden_layers": "2",
         "num_attention_heads": "2", "num_key_value_heads": "1", "head_dim": "8", "num_experts": "4",
         "tokenizer_vocab_size": "64", "dtype": "bf16", "device": "cpu", "optimizer": "master_adamw",
         "sharding": "fsdp", "steps": "10", "lr": "1e-2", "batch_size": "4"}
tokenizer = Tokenizer.wrap(train_tokenizer(["a small text to train on"], 64), "test")


def whole(t):
    """`t` gathered whole; int16 travels as bf16 bits (gloo and NCCL reduce no int16)."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype != torch.int16:
        return t.full_tensor()
    bits = DTensor.from_local(t.to_local().view(torch.bfloat16), t.device_mesh, t.placements, shape=t.shape,
                              stride=t.stride())
    return bits.full_tensor().view(torch.int16)


def local_numel(t):
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def random_grads(model, layout, seed):
    """bf16 gradients of each parameter's whole shape: dense ones alike on every rank,
    expert ones alike on the ranks that hold the same experts (as after reduction)."""
    grads = {}
    for index, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator().manual_seed(seed * 1000 + index * 10 + (layout.ep_rank if is_expert_param(name) else 0))
        grads[name] = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    return grads


def set_grads(model, grads):
    for name, p in model.named_parameters():
        p.grad = shard_like(grads[name].clone(), p)


def state_of(model, optimizer):
    state = {}
    for name, p in model.named_parameters():
        s = optimizer.state[p]
        state[name] = {"param": whole(p.detach()).view(torch.int16).clone(),
                       **{key: whole(t).clone() for key, t in s.items()}}
    return state


layout = init_layout(2, "cpu", 120)
for ep, moments, expert_moments in ((2, "bf16", "8bit"), (4, "fp32", "same")):
    if ep != layout.ep_size:
        layout = mesh_layout(ep, "cpu", layout.timeout)
    folder = out_dir / f"ep{ep}"
    cfg = load_config(None, {**MODEL, "ep_size": str(ep), "moment_dtype": moments, "expert_moments": expert_moments,
                             "checkpoint_dir": str(folder / "ckpt")}, world_size=4)
    folder.mkdir(parents=True, exist_ok=True)

    def build(seed, sharded):
        model = MixtralForCausalLM(cfg.model, TORCH, layout, LoopTier())
        init_weights(model, seed, layout)
        remainders = split_masters(model, cfg)
        if sharded:
            parallelize(model, layout, "fsdp")
        return model, make_optimizer(model, cfg, remainders)

    a, opt_a = build(0, sharded=False)
    b, opt_b = build(0, sharded=True)
    record = {"state_numel": [sum(local_numel(opt.state[p]["remainder"]) for p in model.parameters())
                              for model, opt in ((a, opt_a), (b, opt_b))]}

    # 1. the same forward and backward; the loop's reductions
    gen = torch.Generator().manual_seed(100 + layout.rank)
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.randint(0, 64, (2, 16), generator=gen)
    packed = PackedSequences(torch.arange(16).expand(2, 16), torch.tensor([0, 16, 32], dtype=torch.int32), 16)
    for model, sharding in ((a, "none"), (b, "fsdp")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, packed)
        causal_lm_loss(logits, labels, torch.tensor(4 * 32.0, dtype=torch.float64)).backward()
        reduce_gradients(model, layout, sharding)
    record["grads"] = [{name: whole(p.grad) for name, p in model.named_parameters()} for model in (a, b)]

    # 2. two clipped steps on the same gradients
    grads = {name: p.grad.clone() for name, p in a.named_parameters()}
    norms = []
    for step in range(2):
        set_grads(a, grads)
        set_grads(b, grads)
        (norm_a, scale), (norm_b, _) = (clip_gradients(opt, model, 0.05, layout) for model, opt in ((a, opt_a), (b, opt_b)))
        norms.append((norm_a.item(), norm_b.item(), scale.item()))
        optimizer_step(opt_a, scale)
        optimizer_step(opt_b, scale)
        grads = random_grads(a, layout, step)
    record["norms"] = norms
    record["unsharded"], record["sharded"] = state_of(a, opt_a), state_of(b, opt_b)

    # 3. both models exported
    save_hf_checkpoint(a, folder / "hf_unsharded", layout, torch.bfloat16, tokenizer)
    save_hf_checkpoint(b, folder / "hf_sharded", layout, torch.bfloat16, tokenizer)

    # 4. checkpoint B, resume it into C, step both
    checkpointer = Checkpointer(cfg, layout, torch.device("cpu"), "0" * 64)
    checkpointer.save(TrainState(2, [1.0, 1.0]), b, opt_b, cfg)
    c, opt_c = build(1, sharded=True)
    resumed = checkpointer.load_latest(c, opt_c, cfg)
    d, opt_d = build(1, sharded=False)
    checkpointer.load_latest(d, opt_d, cfg)
    grads = random_grads(a, layout, 7)
    for model, opt in ((b, opt_b), (c, opt_c), (d, opt_d)):
        set_grads(model, grads)
        optimizer_step(opt, None)
    record["resumed_step"] = resumed.step
    record["continued"], record["resumed"] = state_of(b, opt_b), state_of(c, opt_c)
    record["resumed_unsharded"] = state_of(d, opt_d)

    torch.save(record, folder / f"rank{layout.rank}.pt")
shutdown(wait_for_peers=True)
