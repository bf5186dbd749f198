"""Host-built TMA descriptors for the grouped GEMMs (`grouped_gemm.py`, `wgrad_gemm.py`): when
tensors can load through them (`tma_ok`), and the CUDA context the driver needs current on
the calling thread to build them."""

import ctypes
import functools

import torch


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def ensure_cuda_context(device: torch.device) -> None:
    """Make the device's primary context current on this thread.

    Autograd runs the backward on a thread of its own, and the CUDA runtime binds a
    context to a thread only at that thread's first runtime call. Triton encodes host-side
    TMA descriptors through the driver before its launcher binds one, so a backward whose
    first CUDA work is ours failed on an H100 with 'Failed to create tensor map descriptor:
    invalid device context'. This does what Triton's launcher does for the launch itself.
    """
    if device.type != "cuda":
        return
    lib, ctx = _libcuda(), ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), device.index or 0)
    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    lib.cuCtxSetCurrent(ctx)


def descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """The copy engine exists from Hopper (sm_90) on and needs 16-byte aligned base
    addresses and row strides."""
    return all(
        t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9 and t.stride(-1) == 1
        and t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )
