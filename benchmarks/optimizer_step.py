"""One AdamW step over a Mixtral-sized parameter set, timed for several optimizers.

The parameters are shaped like the 2-layer Mixtral-8x7B (`configs/mixtral-8x7b-2layer.yaml`):
embedding and LM head [32000, 4096], per layer q/o [4096, 4096], k/v [1024, 4096], router
[8, 4096], the stacked experts gate_up [8, 28672, 4096] and down [8, 4096, 14336], and the
norms: 3.16e9 parameters, 89% of them in the expert tensors. Every tensor is scaled along
its second-to-last dim (its only dim for vectors) to `--params` in all, 3.1e9 by default.

Columns, one optimizer each (each built on fresh random parameters and bf16 or fp32
gradients, timed, then freed before the next):

- `torch fp32`: torch.optim.AdamW(fused=True) over fp32 parameters; 16 B/param.
- `torch bf16 (no master)`: the same over bf16 parameters, moments in bf16; 8 B/param, and
  small updates are lost to rounding: the speed of light, not a usable recipe.
- `MasterAdamW bf16 m` / `fp32 m`: te_mixtral.optim.MasterAdamW, bf16 parameters, int16
  remainders (exact fp32 master), moments in bf16 or fp32; 10 or 14 B/param.
- `MasterAdamW 8-bit m`: the same with every matrix's moments in 8-bit blocks
  (te_mixtral/optim/moments8.py; `train.expert_moments 8bit` does it for the experts, 89% of
  the parameters here), the vectors' in bf16: 6 B/param (and a scale per 256 values for
  each moment); moved: reads 8, writes 6.
- `TE FusedAdam bf16 m` / `fp32 m`: transformer_engine.pytorch.optimizers.FusedAdam with
  master_weights=True, store_param_remainders=True (the same 16-bit-remainder master),
  exp_avg/exp_avg_sq in bf16 or fp32; skipped where TE does not import.

`B/param` counts what the step's tensors hold per parameter (parameter, gradient, state).
`moved` counts the bytes one step must read and write per parameter at the least (for
MasterAdamW with bf16 moments: reads param, remainder, grad, m, v = 10, writes param,
remainder, m, v = 8). `floor` is moved bytes / the device-to-device copy bandwidth
measured in the same run (bytes read plus written per second), the time no implementation
of that storage layout can beat; `x floor` is the measured time over it.

Timing: benchmarks/common.py's timer, three warm-up steps, then the median of 20 steps, each
between CUDA events. The
gradients stay the same across steps (the traffic of a step does not depend on values).

Run from the repository root:

    python3 -m benchmarks.optimizer_step [--params 3.1e9] [--json results.json] [--quick]

`--quick` runs a tiny size (on the CPU when there is no GPU, with host clocks) to check
that the script works, not to measure anything.
"""

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from benchmarks import common
from benchmarks.common import FAMILIES, copy_bandwidth_gbs, first_line, median_ms
from te_mixtral.measure.report import format_table
from te_mixtral.optim import MasterAdamW
from te_mixtral.te_support import TEUnavailable, require_te

D, F = FAMILIES["8x7b"].hidden, FAMILIES["8x7b"].ffn
VOCAB, KV, E, LAYERS = 32000, 1024, 8, 2
QUICK_PARAMS = 2e5
REPS = 20


def model_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of the 2-layer Mixtral-8x7B, largest first."""
    layer = [(E, 2 * F, D), (E, D, F), (D, D), (D, D), (KV, D), (KV, D), (E, D), (D,), (D,)]
    return [(VOCAB, D), (VOCAB, D)] + layer * LAYERS + [(D,)]


def scaled_shapes(params: float) -> list[tuple[int, ...]]:
    """model_shapes() with the second-to-last dim scaled so the total is about `params`."""
    full = sum(math.prod(s) for s in model_shapes())
    factor = min(1.0, params / full)
    scaled = []
    for shape in model_shapes():
        dim = len(shape) - 2 if len(shape) >= 2 else 0
        scaled.append(shape[:dim] + (max(1, round(shape[dim] * factor)),) + shape[dim + 1:])
    return scaled


@dataclass
class Sizes:
    params: int
    shapes: list[tuple[int, ...]] = field(default_factory=list)


# --- the optimizers ---------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    state_bytes: int  # parameter + gradient + optimizer state, per parameter
    moved_bytes: int  # bytes one step reads and writes per parameter, at the least
    build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    param_dtype: torch.dtype = torch.bfloat16


def te_fused_adam(moment_dtype: torch.dtype):
    def build(params):
        te = require_te()
        return te.optimizers.FusedAdam(
            params, lr=1e-4, weight_decay=0.1, master_weights=True, master_weight_dtype=torch.float32,
            store_param_remainders=True, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
    return build


def master_adamw_8bit(params):
    matrices, vectors = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    return MasterAdamW([{"params": matrices, "moments_8bit": True}, {"params": vectors}], lr=1e-4, weight_decay=0.1,
                       moment_dtype=torch.bfloat16)


def variants() -> list[Variant]:
    return [
        Variant("torch fp32", 16, 28, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True), torch.float32),
        Variant("torch bf16 (no master)", 8, 14, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
        Variant("MasterAdamW bf16 m", 10, 18,
                lambda ps: MasterAdamW(ps, lr=1e-4, weight_decay=0.1, moment_dtype=torch.bfloat16)),
        Variant("MasterAdamW fp32 m", 14, 26,
                lambda ps: MasterAdamW(ps, lr=1e-4, weight_decay=0.1, moment_dtype=torch.float32)),
        Variant("MasterAdamW 8-bit m", 6, 14, master_adamw_8bit),
        Variant("TE FusedAdam bf16 m", 10, 18, te_fused_adam(torch.bfloat16)),
        Variant("TE FusedAdam fp32 m", 14, 26, te_fused_adam(torch.float32)),
    ]


def time_variant(variant: Variant, shapes, device: torch.device) -> float:
    """Median ms of one optimizer step; parameters and state are freed on return."""
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, dtype=variant.param_dtype) * 0.02)
        p.grad = torch.randn(shape, device=device, dtype=variant.param_dtype) * 1e-3
        params.append(p)
    optimizer = variant.build(params)
    try:
        return median_ms(optimizer.step, device, budget_ms=0, min_reps=REPS, max_reps=REPS)
    finally:
        del optimizer, params
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- report --------------------------------------------------------------------------------


def table_row(r: dict) -> list[str]:
    if "ms" not in r:
        return [r["optimizer"], f"{r['state_bytes']}", f"{r['moved_bytes']}", "", f"{r['floor_ms']:.2f}", "",
                r["skipped"]]
    return [r["optimizer"], f"{r['state_bytes']}", f"{r['moved_bytes']}", f"{r['ms']:.2f}",
            f"{r['floor_ms']:.2f}", f"{r['x_floor']:.2f}", ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=3.1e9, help="total parameters (default 3.1e9)")
    common.add_json_flag(parser)
    parser.add_argument("--quick", action="store_true", help="a tiny size: a smoke test, not a measurement")
    common.add_device_flag(parser)
    args = parser.parse_args(argv)
    device = args.device
    if not args.params >= 1:  # NaN too
        parser.error(f"--params must be a number of parameters, 1 or more, got {args.params:g}")
    if device.type != "cuda" and not args.quick:
        parser.error("timing needs a CUDA GPU; use --quick to smoke-test on the CPU")
    shapes = scaled_shapes(QUICK_PARAMS if args.quick else args.params)
    n = sum(math.prod(s) for s in shapes)
    torch.manual_seed(0)

    header = common.run_header(device, sizes=asdict(Sizes(n, shapes)))
    print(common.header_line(header), flush=True)
    bandwidth = copy_bandwidth_gbs(2**24 if args.quick else 2**30, device)
    print(f"one AdamW step over {n:.4g} parameters in {len(shapes)} tensors on {header['device']}; "
          f"copy {bandwidth:.0f} GB/s", flush=True)

    results = []
    for variant in variants():
        r = {"optimizer": variant.name, "state_bytes": variant.state_bytes, "moved_bytes": variant.moved_bytes,
             "floor_ms": variant.moved_bytes * n / (bandwidth * 1e9) * 1e3}
        try:
            r["ms"] = time_variant(variant, shapes, device)
            r["x_floor"] = r["ms"] / r["floor_ms"]
        except TEUnavailable as error:
            r["skipped"] = error.reason
        except Exception as error:  # noqa: BLE001 - one broken optimizer must not end the run
            r["skipped"] = first_line(error)
        print(f"  {variant.name:<24} " + (f"{r['ms']:.2f} ms" if "ms" in r else f"skipped: {r['skipped']}"),
              flush=True)
        results.append(r)

    print()
    print(f"{n} parameters ({n:.4g}), median of {REPS} steps; copy bandwidth {bandwidth:.0f} GB/s "
          "(read + written)")
    print(format_table([table_row(r) for r in results],
                       ["optimizer", "B/param", "moved B/param", "ms/step", "floor ms", "x floor", "note"]))
    print("floor: moved bytes / measured copy bandwidth.")
    common.write_json(args.json, {"header": header, "measured_copy_gbs": bandwidth, "results": results})


if __name__ == "__main__":
    main()
