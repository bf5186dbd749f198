"""Greedy decoding at batch 1: ms per new token of `--generate`'s path (training/generate.py)
and of transformers' `generate` on the same weights, beside the bandwidth floor.

The floor. A decode step must read every dense weight once (attention's four projections, the
router, the norms, the LM head, one embedding row) and, in each layer, the weights of the K
experts its one token is routed to, no more: at batch 1 the other experts are not needed. Those
bytes (bf16) over the copy bandwidth measured in the same run (a device-to-device copy of 1 GiB,
bytes read plus written per second) are the least time a step can take. The KV cache's reads
are left out: 128 KiB per cached position at Mixtral-8x7B's shapes, under 0.1 % of the weights
at the lengths run here.

The columns, greedy tokens after the same random prompt from the same random weights (the run
config's initialisation and seed, bf16 on a GPU, fp32 on a CPU):

- `ours, no cache`: what `--generate` ran before it had a KV cache, a forward over the whole
  sequence for every token;
- `ours, KV cache`: training/generate.py's loop without CUDA graphs (as it runs with several
  ranks, or a tier that waits for the host);
- `ours, KV cache + CUDA graph`: what `--generate` runs on one GPU;
- `transformers`: `MixtralForCausalLM.generate(do_sample=False)` with the cache, attention and
  experts implementation transformers picks by default, over the very tensors of our model
  (assigned, not copied: the whole model would not fit twice).

Each column generates SHORT, then N new tokens after a warm-up run; its ms per token is
(t(N) - t(SHORT)) / (N - SHORT), so the prompt's forward, the graph's capture and any first-call
compilation cancel out. Host clocks around whole generations, which read each token back
anyway. Each column's tokens are compared with transformers': how many leading tokens agree (in
bf16 two implementations can part at a near tie; the first step where they part, transformers'
logit gap between the two tokens says how near).

Where the time goes: the GPU kernels of 8 decode steps of ours (without the graph, so each
kernel shows; the graph replays the same kernels), per token: the expert kernels (the Triton
kernels of te_mixtral/experts/kernels/), cuBLAS's GEMMs (the dense projections, router and LM
head, and attention's own small matmuls) and all other kernels (norms, rotary, attention,
routing, dispatch), each with its kernel count; beside the experts' and the dense weights'
shares of the floor. The kernels' sum against the graphed step's time is what the GPU spends
between kernels.

    python3 -m benchmarks.decode_b1 [--layers N] [--tokens 128] [--prompt-tokens 16]
        [--tier custom_grouped] [--backend auto] [--config configs/mixtral-8x7b.yaml] [--json FILE]

By default the whole Mixtral-8x7B, 93 GB of weights in bf16, on one GPU of 141 GB (an H200);
`--layers 2` is a quick look at full width. On a CPU, `--config configs/tiny.yaml` checks that
the columns agree with transformers (fp32: every token), and measures nothing.
"""

import argparse
import contextlib
import importlib
import json
import pkgutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common
from te_mixtral.config import ModelConfig, load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import TierUnavailable, UserError
from te_mixtral.experts.registry import make_tier
from te_mixtral.model.hf_config import hf_config
from te_mixtral.model.layers import PackedSequences, resolve_backend
from te_mixtral.model.mixtral import MixtralForCausalLM, init_weights
from te_mixtral.training.generate import greedy_generate
from te_mixtral.training.loop import default_dtype

DEFAULT_CONFIG = "configs/mixtral-8x7b.yaml"
SHORT = 8  # new tokens of the shorter run, whose time is taken off the longer's
PROFILED_STEPS = 8
SINGLE = Layout(0, 1, 1, None, None)


def floor_bytes(m: ModelConfig, element_bytes: int) -> dict[str, int]:
    """What one decode step must read at batch 1: the dense weights and the routed experts'."""
    D, Y = m.hidden_size, m.num_hidden_layers
    attention = 2 * D * m.num_attention_heads * m.head_dim + 2 * D * m.num_key_value_heads * m.head_dim
    per_layer = attention + 2 * D + m.num_experts * D  # the projections, two norms, the router
    dense = Y * per_layer + D + m.vocab_size * D + D  # the final norm, the LM head, one embedding row
    experts = Y * m.num_experts_per_tok * 3 * D * m.intermediate_size
    return {"dense": element_bytes * dense, "experts": element_bytes * experts}


def transformers_twin(ours: MixtralForCausalLM, device: torch.device):
    """transformers' Mixtral holding our model's tensors (assigned, not copied), its defaults
    otherwise, never stopping at an eos."""
    from transformers import MixtralForCausalLM as HFMixtralForCausalLM

    with torch.device("meta"):
        hf = HFMixtralForCausalLM(hf_config(ours.config))
    ours_state = ours.state_dict()
    hf.load_state_dict({name: ours_state[name] for name in hf.state_dict()}, strict=True, assign=True)
    with torch.device(device):  # its rotary tables are buffers of no state dict, left on meta
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
    left = [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers' Mixtral holds tensors that are neither ours nor made again: {left}")
    hf.generation_config.eos_token_id = None
    return hf.eval()


@torch.no_grad()
def without_cache(model, prompt: list[int], n: int, device: torch.device, autocast) -> list[int]:
    """What `--generate` ran before the KV cache: a forward over the whole sequence per token."""
    ids = list(prompt)
    for _ in range(n):
        length = len(ids)
        packed = PackedSequences(torch.arange(length, device=device)[None],
                                 torch.tensor([0, length], dtype=torch.int32, device=device), length)
        with autocast:
            ids.append(int(model(torch.tensor([ids], device=device), packed)[0, -1].argmax()))
    return ids[len(prompt):]


def timed(generate, n: int, device: torch.device) -> tuple[float, list[int]]:
    common.synchronize(device)
    start = time.perf_counter()
    tokens = generate(n)
    common.synchronize(device)
    return time.perf_counter() - start, tokens


def per_token_ms(generate, n: int, device: torch.device) -> tuple[float, list[int]]:
    """ms per new token beyond the first SHORT (see the docstring), and the n tokens."""
    generate(SHORT)  # warm-up: compiles, workspaces
    short, _ = timed(generate, SHORT, device)
    long, tokens = timed(generate, n, device)
    return 1e3 * (long - short) / (n - SHORT), tokens


def expert_kernel_names() -> set[str]:
    """The Triton kernels of te_mixtral/experts/kernels/, by the name the profiler gives them."""
    import triton

    from te_mixtral.experts import kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        names |= {name for name, obj in vars(module).items()
                  if isinstance(obj, (triton.runtime.JITFunction, triton.runtime.Autotuner))}
    return names


def kernel_kind(name: str, experts: set[str]) -> str:
    if name in experts:
        return "experts"
    if any(word in name.lower() for word in ("gemm", "gemv", "nvjet", "xmma", "splitkreduce")):
        return "cuBLAS GEMMs"
    return "other"


def kernels_by_kind(generate, n: int) -> dict[str, dict[str, float]]:
    """{kind: {"ms", "kernels"}} of the GPU kernels of `generate(n)`."""
    with tempfile.TemporaryDirectory() as folder:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            generate(n)
            torch.cuda.synchronize()
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    experts, kinds = expert_kernel_names(), {}
    for event in events:
        if event.get("cat") == "kernel":
            kind = kinds.setdefault(kernel_kind(event["name"], experts), {"ms": 0.0, "kernels": 0})
            kind["ms"] += event["dur"] / 1e3
            kind["kernels"] += 1
    return kinds


def decode_kernels(generate) -> dict[str, dict[str, float]]:
    """Per decode step: the kernels of PROFILED_STEPS steps, the prompt's forward taken off."""
    generate(2)  # warm-up
    base, more = kernels_by_kind(generate, 2), kernels_by_kind(generate, 2 + PROFILED_STEPS)
    empty = {"ms": 0.0, "kernels": 0}
    return {kind: {key: (more[kind][key] - base.get(kind, empty)[key]) / PROFILED_STEPS for key in ("ms", "kernels")}
            for kind in more}


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens are the same."""
    agree = 0
    while agree < min(len(tokens), len(reference)) and tokens[agree] == reference[agree]:
        agree += 1
    return agree


@torch.no_grad()
def logit_gap(hf, prompt: list[int], reference: list[int], other: list[int], device: torch.device) -> float | None:
    """At the first step where `other` leaves transformers' tokens: transformers' logit of its
    own pick minus that of `other`'s (small: a near tie that rounding can turn)."""
    step = agreement(other, reference)
    if step >= min(len(other), len(reference)):
        return None
    logits = hf(torch.tensor([prompt + reference[:step]], device=device)).logits[0, -1].float()
    return float(logits[reference[step]] - logits[other[step]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the model's shapes (and seed): a run config")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    parser.add_argument("--tokens", type=int, default=128, help=f"new tokens per timed generation (> {SHORT})")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length")
    parser.add_argument("--tier", default="custom_grouped", help="our expert tier")
    parser.add_argument("--backend", default="auto", choices=("auto", "te", "torch"), help="our layer backend")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    error = None
    if args.tokens <= SHORT or args.prompt_tokens < 1 or (args.layers is not None and args.layers < 1):
        error = f"--tokens must be more than {SHORT}, --prompt-tokens and --layers at least 1"
    elif device.type != "cuda" and args.config == DEFAULT_CONFIG:
        error = "the full model needs a CUDA GPU; on a CPU, check the columns with --config configs/tiny.yaml"
    if error is None:
        try:
            overrides = {"tier": args.tier, "backend": args.backend}
            if args.layers is not None:
                overrides["model.num_hidden_layers"] = str(args.layers)
            cfg = load_config(args.config, overrides)
            tier = make_tier(cfg.tier, cfg)
            tier.check_available(device)
            backend = resolve_backend(cfg.backend, device.type)
        except (UserError, TierUnavailable) as problem:
            error = str(problem)
    if error is not None:
        print(f"decode_b1: error: {error}", file=sys.stderr)
        return 2

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m = cfg.model
    header = common.run_header(device, layers=m.num_hidden_layers, tier=cfg.tier, backend=backend.name,
                               dtype=str(dtype).removeprefix("torch."), prompt_tokens=args.prompt_tokens,
                               new_tokens=args.tokens, short=SHORT, seed=cfg.train.seed)
    print(common.header_line(header), flush=True)
    with torch.device(device), default_dtype(dtype):
        ours = MixtralForCausalLM(m, backend, SINGLE, tier).eval()
    init_weights(ours, cfg.train.seed, SINGLE)
    hf = transformers_twin(ours, device)
    bandwidth = common.copy_bandwidth_gbs(2**30 if device.type == "cuda" else 2**24, device)
    floor = floor_bytes(m, dtype.itemsize)
    floor_ms = {part: 1e3 * nbytes / (bandwidth * 1e9) for part, nbytes in floor.items()}
    total_floor_ms = sum(floor_ms.values())
    print(f"Mixtral, {m.num_hidden_layers} layers, {header['dtype']}, tier {cfg.tier}, backend {backend.name} on "
          f"{header['device']}: copy {bandwidth:.0f} GB/s; a decode step reads at least {sum(floor.values()) / 1e9:.2f} "
          f"GB (dense {floor['dense'] / 1e9:.2f}, experts {floor['experts'] / 1e9:.2f}): {total_floor_ms:.3f} ms",
          flush=True)

    generator = torch.Generator().manual_seed(cfg.train.seed)
    prompt = torch.randint(0, m.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
    autocast = torch.autocast(device.type, dtype=dtype) if device.type == "cuda" else contextlib.nullcontext()
    positions = args.prompt_tokens + args.tokens

    def ours_generate(graphs: bool):
        return lambda n: greedy_generate(ours, prompt, n, -1, SINGLE, device, autocast, positions, graphs)

    def hf_generate(n: int) -> list[int]:
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
        return out[0, len(prompt):].tolist()

    columns = {"transformers": hf_generate,
               "ours, no cache": lambda n: without_cache(ours, prompt, n, device, autocast),
               "ours, KV cache": ours_generate(graphs=False)}
    skipped = {}
    if device.type == "cuda":
        columns["ours, KV cache + CUDA graph"] = ours_generate(graphs=True)
    else:
        skipped["ours, KV cache + CUDA graph"] = "CUDA graphs need a GPU"
    results = {}
    for name, generate in columns.items():
        try:
            ms, tokens = per_token_ms(generate, args.tokens, device)
        except Exception as problem:  # noqa: BLE001 - one column that cannot run must not end the run
            skipped[name] = common.first_line(problem)
            print(f"  {name:<28} skipped: {skipped[name]}", flush=True)
            continue
        results[name] = {"ms_per_token": ms, "x_floor": ms / total_floor_ms, "tokens": tokens}
        print(f"  {name:<28} {ms:8.3f} ms/token  {ms / total_floor_ms:6.2f}x the floor", flush=True)
    reference = results.get("transformers", {}).get("tokens")
    for name, r in results.items():
        if reference is not None:
            r["agree_with_transformers"] = agreement(r["tokens"], reference)
            r["transformers_logit_gap_where_they_part"] = logit_gap(hf, prompt, reference, r["tokens"], device)

    breakdown = None
    if device.type == "cuda":
        breakdown = decode_kernels(ours_generate(graphs=False))
        shares = {"experts": floor_ms["experts"], "cuBLAS GEMMs": floor_ms["dense"]}
        for kind, k in breakdown.items():
            k["floor_ms"] = shares.get(kind)

    # --- report
    print(f"\nms per new token, batch 1 (the floor: {total_floor_ms:.3f} ms at {bandwidth:.0f} GB/s)")
    for name, r in results.items():
        agree = r.get("agree_with_transformers")
        gap = r.get("transformers_logit_gap_where_they_part")
        parted = "" if gap is None else f", then part where transformers' logit gap is {gap:.3g}"
        agreed = "" if agree is None else f"; first {agree} of {len(r['tokens'])} tokens as transformers'{parted}"
        print(f"  {name:<28} {r['ms_per_token']:8.3f}  {r['x_floor']:6.2f}x floor{agreed}")
    for name, reason in skipped.items():
        print(f"  {name:<28} skipped: {reason}")
    if breakdown:
        print(f"\nours, one decode step's GPU kernels ({PROFILED_STEPS} steps profiled, without the graph):")
        for kind, k in sorted(breakdown.items()):
            share = "" if k["floor_ms"] is None else f"  (floor {k['floor_ms']:.3f} ms: {k['ms'] / k['floor_ms']:.2f}x)"
            print(f"  {kind:<14} {k['ms']:8.3f} ms in {k['kernels']:.0f} kernels{share}")
        print(f"  {'all':<14} {sum(k['ms'] for k in breakdown.values()):8.3f} ms in "
              f"{sum(k['kernels'] for k in breakdown.values()):.0f} kernels")
    common.write_json(args.json, {
        "header": header, "measured_copy_gbs": bandwidth, "floor_bytes": floor, "floor_ms": floor_ms,
        "floor_total_ms": total_floor_ms, "prompt": prompt, "columns": results, "skipped": skipped,
        "transformers": {"attention": hf.config._attn_implementation,
                         "experts": getattr(hf.config, "_experts_implementation", None)},
        "decode_kernels": breakdown})
    return 0


if __name__ == "__main__":
    sys.exit(main())
