"""8-bit block-wise moments (te_mixtral/optim/moments8.py) and MasterAdamW's groups that use them.

The format is checked against a float64 reference built from its definition (every code's
value enumerated, the nearest one picked), not from the bit operations it is computed
with; an update against a float64 AdamW started from the dequantised moments; and whole
runs of steps against fp32 moments fed the same gradients, where the 8-bit moments may
differ by the rounding the format allows, accumulated as the moments' decay lets it (a bound
that holds whatever the gradients). The Triton kernel's bits: test_adamw_kernel.py. Units:
test_master_adamw.py.
"""

import dataclasses
import math

import pytest
import torch
from adamw_reference import (
    CLIP,
    U,
    bf16_grads,
    bits,
    error_in_u,
    fp32_weights,
    save_and_resume,
)

from te_mixtral.config_checks import MOMENTS_8BIT_BLOCK
from te_mixtral.optim import MasterAdamW
from te_mixtral.optim.adamw_torch import StepScalars, adamw_update_8bit_torch
from te_mixtral.optim.bits import join_master, split_master
from te_mixtral.optim.master_adamw import MOMENTS_8BIT
from te_mixtral.optim.moments8 import (
    BLOCK,
    EXP_AVG,
    SQRT_EXP_AVG_SQ,
    Format,
    dequantize,
    quantize,
    rounding_salt,
)

FORMATS = {"exp_avg": EXP_AVG, "sqrt_exp_avg_sq": SQRT_EXP_AVG_SQ}
# The formats rounded to nearest: the stochastic one's codes and rounding to nearest, whose
# bit operations it shares (everything but the last step), checked against the reference.
NEAREST = {name: dataclasses.replace(fmt, stochastic=False) for name, fmt in FORMATS.items()}


def code_values(fmt: Format) -> torch.Tensor:
    """Each code's value relative to its block's scale, in float64, from the format's definition:
    4 exponent bits whose top binade [1, 2) is the scale's, subnormals below 2^-14."""
    values = []
    for code in range(256):
        magnitude = code & fmt.max_magnitude
        e, fraction = magnitude >> fmt.mantissa, (magnitude % 2**fmt.mantissa) / 2**fmt.mantissa
        value = (1 + fraction) * 2.0 ** (e - 15) if e else fraction * 2.0**-14
        values.append(-value if fmt.signed and code >= 128 else value)
    return torch.tensor(values, dtype=torch.float64)


def reference(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The nearest representable value of each x in float64 (ties: the one `quantize` gives is
    checked by distance), scale 2^floor(log2 max|x|) per block, at least 2^-108; a nonzero
    value stays nonzero where the format says so."""
    x64 = x.double().view(-1, BLOCK)
    amax = x64.abs().amax(dim=1, keepdim=True)
    scale = 2.0 ** torch.floor(torch.log2(amax.clamp(min=2.0**-108)))
    grid = code_values(fmt)
    nearest = grid[(x64.unsqueeze(-1) / scale.unsqueeze(-1) - grid).abs().argmin(dim=-1)] * scale
    if fmt.nonzero_stays_nonzero:
        smallest = grid[1] * scale.expand_as(nearest)
        nearest = torch.where((nearest == 0) & (x64 != 0), smallest, nearest)
    return nearest.view(-1)


def moments_like(n: int, seed: int, signed: bool) -> torch.Tensor:
    """Values spread over many binades, as moments are, and blocks of very different sizes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    x = x * torch.exp(torch.randn(n // BLOCK, 1, generator=gen) * 10).expand(-1, BLOCK).reshape(-1)
    return x if signed else x.abs()


def test_block_is_the_configs():
    assert BLOCK == MOMENTS_8BIT_BLOCK


@pytest.mark.parametrize("name", NEAREST)
def test_quantize_rounds_to_the_nearest_value_of_the_format(name):
    fmt = NEAREST[name]
    x = moments_like(BLOCK * 400, 1, fmt.signed)
    x[:BLOCK] = torch.where(torch.arange(BLOCK) % 2 == 0, x[:BLOCK], x[:BLOCK] * 1e-7)  # far below the block's top
    x[BLOCK:2 * BLOCK] = 0.0  # a block of zeros
    x[3 * BLOCK:4 * BLOCK] *= 1e-32 / x[3 * BLOCK:4 * BLOCK].abs().max()  # below the smallest scale
    x[4 * BLOCK:4 * BLOCK + 9] = torch.tensor([1e-45, -1e-45, 1e-40, 1e-38, 0.0, -0.0, 2e-38, 1e-39, 3e-45])
    x[2 * BLOCK + 5] = x[2 * BLOCK:3 * BLOCK].abs().max() * 1.999  # its top rounds past the largest code
    codes, scales = quantize(x, fmt)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32 and scales.numel() == x.numel() // BLOCK
    got, want = dequantize(codes, scales, fmt).double(), reference(x, fmt)
    distance, best = (got - x.double()).abs(), (want - x.double()).abs()
    assert torch.equal(distance, best)  # the nearest value (equal distances at a tie)
    # What that means in numbers: half a code step of relative error in the normal range
    # (the clamped largest value: under one step), half the subnormal unit below it.
    scale = scales.double().repeat_interleave(BLOCK)
    normal = x.double().abs() >= 2.0**-14 * scale
    assert (distance[normal] <= 2.0 ** -fmt.mantissa * x.double().abs()[normal]).all()
    unclamped = normal & (x.double().abs() < (2 - 2.0 ** -fmt.mantissa) * scale)
    assert (distance[unclamped] <= 2.0 ** -(fmt.mantissa + 1) * x.double().abs()[unclamped]).all()
    if not fmt.nonzero_stays_nonzero:
        assert (distance[~normal] <= fmt.subnormal_unit / 2 * scale[~normal]).all()
    assert torch.equal(got[BLOCK:2 * BLOCK], torch.zeros(BLOCK, dtype=torch.float64))
    assert (got[x != 0] != 0).all() if fmt.nonzero_stays_nonzero else (got[:BLOCK] == 0).any()
    # Quantising what was read back changes nothing.
    again = quantize(dequantize(codes, scales, fmt), fmt)
    assert torch.equal(again[0], codes) and torch.equal(bits(again[1]), bits(scales))


def neighbours(x: torch.Tensor, fmt: Format, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's values just below and just above each |x| (equal where x is a value), in
    float64, from the reference's code grid and the block scales quantize chose."""
    grid = code_values(fmt)[: fmt.max_magnitude + 1]  # magnitudes, ascending
    scale = scales.double().repeat_interleave(BLOCK)
    relative = x.double().abs() / scale
    above = torch.searchsorted(grid, relative).clamp(max=grid.numel() - 1)
    below = torch.where(grid[above] == relative, above, (above - 1).clamp(min=0))
    return grid[below] * scale, grid[above] * scale


def test_stochastic_rounding_picks_a_neighbour_and_is_exact_on_average():
    """Each value becomes the format's value just below or just above it, never another, and
    averaged over salts (steps) the stored value is the value itself: up with probability
    (x - below) / (above - below). A rounding to nearest fails the average; a biased random
    bit (a wrong mask or shift) fails it too."""
    fmt, salts = SQRT_EXP_AVG_SQ, 400
    x = moments_like(BLOCK * 8, 4, signed=False)
    x = x / x.view(-1, BLOCK).amax(dim=1).repeat_interleave(BLOCK) * 1.9  # every scale 1: sums comparable
    below, above = neighbours(x, fmt, torch.ones(x.numel() // BLOCK))
    total = torch.zeros_like(x, dtype=torch.float64)
    for step in range(1, salts + 1):
        codes, scales = quantize(x, fmt, rounding_salt(step))
        assert torch.equal(scales, torch.ones_like(scales))
        got = dequantize(codes, scales, fmt).double()
        smallest = code_values(fmt)[1]
        assert ((got == below) | (got == above) | ((below == 0) & (got == smallest))).all(), step
        total += got
    normal = below > 0
    p = ((x.double() - below) / (above - below).clamp(min=1e-300))[normal]
    mean_error = (total / salts - x.double())[normal] / (above - below)[normal]  # in code steps
    # Binomial: the mean of `salts` draws is p, give or take sqrt(p (1 - p) / salts) steps;
    # over 2,000 values the average error is that divided by sqrt(2,000) again.
    assert (mean_error.abs() <= 5 * (p * (1 - p) / salts).sqrt() + 1e-12).all()
    assert mean_error.mean().abs() <= 5 * 0.5 / math.sqrt(salts * normal.sum().item())
    assert ((p > 0.2) & (p < 0.8)).sum() > 500  # many values strictly between two codes


def test_a_salt_is_required_for_a_stochastic_format():
    with pytest.raises(ValueError, match="salt"):
        quantize(torch.ones(BLOCK), SQRT_EXP_AVG_SQ)


def test_signed_format_is_symmetric():
    x = moments_like(BLOCK * 16, 2, signed=True)
    (codes, scales), (neg_codes, neg_scales) = quantize(x, EXP_AVG), quantize(-x, EXP_AVG)
    assert torch.equal(dequantize(neg_codes, neg_scales, EXP_AVG), -dequantize(codes, scales, EXP_AVG))


def test_a_non_finite_value_spoils_its_block_only():
    x = moments_like(BLOCK * 4, 3, signed=True)
    x[BLOCK + 7], x[2 * BLOCK + 9], x[2 * BLOCK + 10] = float("nan"), float("-inf"), -float("nan")
    codes, scales = quantize(x, EXP_AVG)
    values = dequantize(codes, scales, EXP_AVG).view(4, BLOCK)
    assert values[1:3].isnan().all()  # never read back as numbers
    # and nothing of them kept: a NaN's sign, say, is the CPU's or the GPU's own
    assert (codes.view(4, BLOCK)[1:3] == 0).all()
    assert values[0].isfinite().all() and values[3].isfinite().all()
    assert torch.equal(values[[0, 3]], dequantize(*quantize(x.view(4, BLOCK)[[0, 3]].reshape(-1), EXP_AVG),
                                                  EXP_AVG).view(2, BLOCK))


# --- one update against float64 AdamW ----------------------------------------------------------


def state_8bit(n: int, seed: int):
    """Random 8-bit moments as a run would hold them: m signed, sqrt(v) of the size of |m|."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * 1e-3
    sqrt_v = m.abs() * (1 + 3 * torch.rand(n, generator=gen))
    return [*quantize(m, EXP_AVG), *quantize(sqrt_v, SQRT_EXP_AVG_SQ, rounding_salt(seed))]


def test_one_update_is_float64_adamw_from_the_read_back_moments():
    """The master follows a float64 AdamW step taken from the moments as read back, to the
    precision of one fp32 update; the stored moments are that step's, rounded by the format."""
    n, lr, wd, step = BLOCK * 64, 1e-3, 0.1, 4
    w, g = fp32_weights(n, 4), bf16_grads(1, n, 5)[0]
    param_bits, remainder = split_master(w)
    state = state_8bit(n, 6)
    m0 = dequantize(state[0], state[1], EXP_AVG).double()
    v0 = dequantize(state[2], state[3], SQRT_EXP_AVG_SQ).double() ** 2
    adamw_update_8bit_torch(param_bits.view(torch.bfloat16), remainder, g, *state,
                            StepScalars.for_step(lr, wd, 0.9, 0.999, 1e-8, step), CLIP)

    g64 = g.double() * CLIP.double()
    m = 0.9 * m0 + 0.1 * g64
    v = 0.999 * v0 + 0.001 * g64**2
    expected = w.double() * (1 - lr * wd) - lr / (1 - 0.9**step) * m / (v.sqrt() / math.sqrt(1 - 0.999**step) + 1e-8)
    assert error_in_u(join_master(param_bits, remainder), expected, lr) <= 4  # one step's rounding (measured: 2.0)
    for codes, scales, fmt, exact in ((state[0], state[1], EXP_AVG, m), (state[2], state[3], SQRT_EXP_AVG_SQ, v.sqrt())):
        stored = dequantize(codes, scales, fmt).double()
        scale = scales.double().repeat_interleave(BLOCK)
        rounding = 2.0 ** -fmt.mantissa if fmt.stochastic else 2.0 ** -(fmt.mantissa + 1)  # a step, or half
        bound = rounding * exact.abs() + fmt.subnormal_unit * scale + 4 * U * exact.abs()
        assert ((stored - exact).abs() <= bound).all()


# --- many steps against fp32 moments ---------------------------------------------------------


def pair(n_rows: int, width: int, seed: int, **kwargs):
    """MasterAdamW with 8-bit moments and one with fp32 moments, over the same fp32 weights."""
    w = fp32_weights(n_rows * width, seed).view(n_rows, width)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    eight = MasterAdamW.from_fp32([{"params": [a], "moments_8bit": True}], impl="torch", **kwargs)
    fp32 = MasterAdamW.from_fp32([b], impl="torch", moment_dtype=torch.float32, **kwargs)
    return (a, eight), (b, fp32)


def test_moments_differ_from_fp32_moments_by_the_formats_rounding_alone():
    """Fed the same gradients (drawn, not computed from the weights), the 8-bit moments differ
    from fp32 ones only by what rounding each step's new moment to the format adds, decayed
    by beta since: e_t = beta e_{t-1} + q_t with |q_t| within the format's rounding of the new
    moment. A wrong beta, a lost block scale or a moment read as another's breaks the bound
    at once; the masters stay close (the update divides m by sqrt(v), each within a few %)."""
    steps, lr, beta1, beta2 = 30, 1e-3, 0.9, 0.95
    (a, eight), (b, fp32) = pair(8, 4 * BLOCK, 7, lr=lr, betas=(beta1, beta2), weight_decay=0.1)
    gen = torch.Generator().manual_seed(8)
    bound_m = bound_v = 0
    for t in range(steps):
        # Gradients whose size changes by orders of magnitude across blocks and over time.
        g = (torch.randn(a.shape, generator=gen) * torch.exp(torch.randn(a.shape[0], 1, generator=gen) * 2) * 1e-3)
        a.grad, b.grad = g.bfloat16(), g.bfloat16()
        eight.step()
        fp32.step()
        s8, s32 = eight.state[a], fp32.state[b]
        m8 = dequantize(s8["exp_avg_codes"].view(-1), s8["exp_avg_scales"], EXP_AVG).double()
        sqrt_v8 = dequantize(s8["sqrt_exp_avg_sq_codes"].view(-1), s8["sqrt_exp_avg_sq_scales"], SQRT_EXP_AVG_SQ)
        v8 = sqrt_v8.double() ** 2
        m_scale = s8["exp_avg_scales"].double().repeat_interleave(BLOCK)
        v_scale = s8["sqrt_exp_avg_sq_scales"].double().repeat_interleave(BLOCK)
        # This step's rounding of each (relative to the stored value, which is within it of the exact one).
        q_m = 2.0**-4 / (1 - 2.0**-4) * m8.abs() + EXP_AVG.subnormal_unit * m_scale
        # sqrt(v) rounded at random: up to a whole code step (2^-4) off, not half of one.
        q_v = ((1 + 2.0**-4) ** 2 - 1) / (1 - 2.0**-4) ** 2 * v8 + (SQRT_EXP_AVG_SQ.subnormal_unit * v_scale) ** 2 * 3
        bound_m = beta1 * bound_m + q_m + 16 * U * m8.abs()
        bound_v = beta2 * bound_v + q_v + 16 * U * v8
        assert ((m8 - s32["exp_avg"].view(-1).double()).abs() <= bound_m).all(), t
        assert ((v8 - s32["exp_avg_sq"].view(-1).double()).abs() <= bound_v).all(), t
    gap = (eight.master(a) - fp32.master(b)).abs()
    print(f"8-bit vs fp32 moments after {steps} steps: masters differ by up to {gap.max() / lr:.3f} lr, "
          f"{gap.mean() / lr:.4f} lr on average")
    assert gap.max() <= 0.15 * lr * steps and gap.mean() <= 0.02 * lr * steps  # measured: 0.065, 0.011


def test_updates_keep_their_size_as_the_gradients_shrink():
    """Gradients that shrink twentyfold over 300 steps, as training's do: v must decay with them,
    by beta2 a step, or the steps lr * m / sqrt(v) shrink with the gradients. Rounded to nearest,
    sqrt(v) decays by less than half a code step a step and never moves: the 8-bit masters then
    move under a fifth as far as fp32 moments' over the last 100 steps. Rounded at random, the
    same distance within a few per cent, and direction for direction."""
    steps, lr = 300, 1e-4
    (a, eight), (b, fp32) = pair(4, 2 * BLOCK, 14, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(15)
    amplitude = torch.exp2(-8 * torch.rand(a.shape, generator=gen))  # 8 binades inside every block
    signal = 0.3 * torch.randn(a.shape, generator=gen)  # a persistent part, so that m does not average to 0
    moved_8bit, moved_fp32 = [], []
    for t in range(1, steps + 1):
        g = amplitude * (math.exp(-t / 80) + 0.05) * (signal + torch.randn(a.shape, generator=gen)) * 1e-3
        before = eight.master(a).clone(), fp32.master(b).clone()
        a.grad, b.grad = g.bfloat16(), g.bfloat16()
        eight.step()
        fp32.step()
        if t > steps - 100:
            moved_8bit.append((eight.master(a) - before[0]).double())
            moved_fp32.append((fp32.master(b) - before[1]).double())
    d8, d32 = torch.stack(moved_8bit), torch.stack(moved_fp32)
    size = (d8.abs().sum() / d32.abs().sum()).item()
    along = ((d8 * d32).sum() / (d32 * d32).sum()).item()
    print(f"last 100 steps: 8-bit updates {size:.3f} the size of fp32 moments', {along:.3f} along them")
    assert 0.95 <= size <= 1.05 and 0.95 <= along <= 1.05  # measured: 0.998 and 0.998


def test_a_tiny_second_moment_never_becomes_a_zero_denominator():
    """A value whose |g| is 1e-9 of its block's largest: its sqrt(v) lies far below the format's
    smallest code, which it is rounded up to; its step stays below lr (a zero there would make
    it lr * m / eps, 1e-3 / 1e-8 = 1e5 times larger)."""
    lr, width = 1e-3, 2 * BLOCK
    (a, eight), _ = pair(2, width, 9, lr=lr, weight_decay=0.0)
    g = torch.full(a.shape, 1e-12)
    g[:, 0] = 1e-3
    before = eight.master(a).clone()
    for _ in range(3):
        a.grad = g.bfloat16()
        eight.step()
    assert ((eight.master(a) - before).abs() <= 3 * lr * 1.01).all()
    sqrt_v = eight.state[a]["sqrt_exp_avg_sq_codes"]
    assert (sqrt_v != 0).all()


def test_groups_without_8bit_moments_are_unchanged():
    """A group's option: the other groups step as MasterAdamW always has, bit for bit."""
    w = fp32_weights(4 * BLOCK * 2, 10).view(4, 2 * BLOCK)
    results = []
    for eight_bit_group in (False, True):
        dense, experts = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        opt = MasterAdamW.from_fp32([{"params": [dense]}, {"params": [experts], "moments_8bit": eight_bit_group}],
                                    lr=1e-3, impl="torch")
        for g in bf16_grads(3, w.numel(), 11):
            dense.grad, experts.grad = g.view(w.shape).clone(), g.view(w.shape).clone()
            opt.step()
        results.append((bits(opt.master(dense)), opt.state[experts]))
    assert torch.equal(results[0][0], results[1][0])
    assert set(results[1][1]) == {"step", "remainder", *MOMENTS_8BIT}
    assert set(results[0][1]) == {"step", "remainder", "exp_avg", "exp_avg_sq"}


def test_constructor_rejects_parameters_that_do_not_split_into_blocks():
    with pytest.raises(ValueError, match="multiples of 256"):
        MasterAdamW([{"params": [torch.nn.Parameter(torch.zeros(4, 100, dtype=torch.bfloat16))], "moments_8bit": True}])
    with pytest.raises(ValueError, match="two or more dimensions"):
        MasterAdamW([{"params": [torch.nn.Parameter(torch.zeros(512, dtype=torch.bfloat16))], "moments_8bit": True}])


def test_state_dict_round_trip_is_bit_exact():
    """Codes, scales, remainders and step counts come back in their own dtypes, and the resumed
    optimizer steps as the saved one does, bit for bit."""
    w = fp32_weights(3 * 2 * BLOCK, 12).view(3, 2 * BLOCK)
    grads = bf16_grads(6, w.numel(), 13)

    def make():
        ps = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())]
        return ps, MasterAdamW.from_fp32([{"params": [ps[0]], "moments_8bit": True}, {"params": [ps[1]]}], lr=1e-3,
                                         impl="torch")

    def step(ps, opt, g):
        for p in ps:
            p.grad = g.view(w.shape).clone()
        opt.step()

    (ps, opt), (resumed_ps, resumed) = save_and_resume(make, step, grads, 3)
    for key, t in opt.state[ps[0]].items():
        loaded = resumed.state[resumed_ps[0]][key]
        assert loaded.dtype == t.dtype and torch.equal(bits(loaded), bits(t)), key
    for g in grads[3:]:
        step(ps, opt, g)
        step(resumed_ps, resumed, g)
    for p, q in zip(ps, resumed_ps):
        assert torch.equal(bits(resumed.master(q)), bits(opt.master(p)))
