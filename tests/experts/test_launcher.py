"""The direct launch's cache key (te_mixtral/experts/kernels/launcher.py), checked without a GPU.

`launch` keeps each compiled kernel under a key and launches it again for every call with that
key, so the key must tell apart every two calls that Triton would compile apart, or a kernel
compiled for one would run another's arguments (an unaligned pointer through vector loads
compiled for aligned ones). And it must not tell apart calls that differ only where a training
step differs from the last (the rows, fresh tensors), or every step would pay Triton's dispatch
again. Both are checked here on the real kernels' arguments, with Triton's binder for sm_90
(no GPU needed) and Triton's own cache key as the reference.
"""

import os

import pytest
import torch
from triton.backends.compiler import GPUTarget

from te_mixtral.experts.kernels import launcher
from te_mixtral.experts.kernels.grouped_gemm import EPI_SWIGLU, _rows_gemm
from te_mixtral.experts.kernels.wgrad_gemm import _wgrad_gemm

# Under Triton's interpreter kernels are interpreted, never bound; `launch` leaves them to it.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="binds for a GPU")

L, D, F = 2, 256, 384


def rows_call(R=64, dtype=torch.bfloat16, offset=0, N=F, write_act=True, warps=4, block_m=64):
    """`_rows_gemm`'s arguments as grouped_gemm.rows_gemm passes them for the SwiGLU forward,
    pointer loads, stream-K on; `offset` elements into x (its pointer's alignment)."""
    x = torch.zeros(R * D + offset, dtype=dtype)[offset:].view(R, D)
    w = torch.zeros(L * 2 * N, D, dtype=dtype)
    act, h = torch.zeros(R, N, dtype=dtype), torch.zeros(R, 2 * N, dtype=dtype)
    scratch, arrivals = torch.zeros(12, block_m, 64), torch.zeros(3, dtype=torch.int32)
    counts = torch.tensor([R // 2, R - R // 2])
    args = (x, w, counts, act, h, scratch, arrivals, None, None, None, None, None, 0, 0, R, N, D, L, 2 * N)
    kwargs = dict(EPILOGUE=EPI_SWIGLU, B_ICONTIG=True, WRITE_ACT=write_act, SCALED=False, ADD=False, B_NF4=False,
                  USE_TMA=False, EVEN_I=True, DOT_PREC="tf32", BLOCK_M=block_m, BLOCK_N=64, BLOCK_I=128, GROUP_M=8,
                  BLOCK_L=2, FLATTEN=False, EPI_PARTS=2, TAIL_SPLIT=4, num_warps=warps, num_stages=4)
    return args, kwargs


def wgrad_call(R=64, k_major=False):
    g, x = torch.zeros(R, D, dtype=torch.bfloat16), torch.zeros(R, F, dtype=torch.bfloat16)
    out = torch.zeros(L, D, F, dtype=torch.bfloat16)
    args = (g, x, torch.tensor([R, 0]), out, None, None, D, F, L, R)
    kwargs = dict(USE_TMA=False, DOT_PREC="tf32", K_MAJOR=k_major, SCALED=False, ACCUMULATE=False, BLOCK_M=128,
                  BLOCK_N=128, BLOCK_I=64, GROUP_M=8, BLOCK_L=2, EPI_PARTS=2, num_warps=4, num_stages=3)
    return args, kwargs


@pytest.fixture(scope="module")
def backend():
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32))


def keys(kernel, backend, call):
    """(our key, Triton's key) of one call."""
    from triton.runtime.jit import compute_cache_key

    args, kwargs = call
    binder = launcher.binder_for(kernel, backend)
    _, specialization, options = binder(*args, **kwargs)
    return launcher.cache_key(kernel, 0, binder, *args, **kwargs), compute_cache_key({}, specialization, options)


ROWS_CALLS = {
    "base": rows_call(),
    "fresh tensors, other rows": rows_call(R=80),  # R is not specialised: a new step, one compile
    "one row": rows_call(R=1),
    "unaligned x": rows_call(offset=1),
    "x 16 bytes in": rows_call(offset=8),
    "N not a multiple of 16": rows_call(N=F + 8),
    "fp32": rows_call(dtype=torch.float32),
    "WRITE_ACT 1, not True": rows_call(write_act=1),
    "8 warps": rows_call(warps=8),
    "32-row tiles": rows_call(block_m=32),
}


@pytest.mark.parametrize("kernel,calls", [(_rows_gemm, ROWS_CALLS),
                                          (_wgrad_gemm, {"base": wgrad_call(), "other rows": wgrad_call(R=48),
                                                         "k-major": wgrad_call(k_major=True)})],
                         ids=["rows_gemm", "wgrad_gemm"])
def test_the_key_parts_every_two_calls_triton_compiles_apart(kernel, calls, backend):
    ours, triton = {}, {}
    for name, call in calls.items():
        ours[name], triton[name] = keys(kernel, backend, call)
    for a in calls:
        for b in calls:
            if triton[a] != triton[b]:
                assert ours[a] != ours[b], f"{a} and {b}: Triton compiles them apart, the launch cache would not"


def test_a_training_step_with_new_rows_and_tensors_finds_its_kernel(backend):
    base, step = keys(_rows_gemm, backend, rows_call())[0], keys(_rows_gemm, backend, rows_call(R=80))[0]
    assert base == step
    assert keys(_wgrad_gemm, backend, wgrad_call())[0] == keys(_wgrad_gemm, backend, wgrad_call(R=48))[0]


def test_the_calls_that_compile_apart_are_kept_apart(backend):
    """The cases above that must differ do (the parametrised test alone would pass if Triton's
    key never differed)."""
    base = keys(_rows_gemm, backend, ROWS_CALLS["base"])
    for name in ("unaligned x", "N not a multiple of 16", "fp32", "WRITE_ACT 1, not True", "8 warps",
                 "32-row tiles"):
        assert keys(_rows_gemm, backend, ROWS_CALLS[name])[0] != base[0], name
    assert keys(_rows_gemm, backend, ROWS_CALLS["x 16 bytes in"])[0] == base[0]  # still 16-byte aligned


def test_through_triton_is_undone_on_the_way_out():
    with pytest.raises(RuntimeError), launcher.through_triton():
        assert not launcher._direct
        raise RuntimeError
    assert launcher._direct
