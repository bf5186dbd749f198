"""Launching a compiled Triton kernel again without Triton's per-call dispatch.

`kernel[grid](*args)` goes through `JITFunction.run` on every call: it reads Triton's knobs,
looks up the device and stream, binds and specialises every argument, turns the
specialisation and the options into a string to look the compiled kernel up, checks that the
globals the kernel read have not changed since it compiled (ours read constexprs only:
tests/test_kernel_globals.py), and only then calls the compiled launcher. With few rows per
expert a GEMM's GPU work is shorter than that: custom_grouped launches six kernels a fwd+bwd
(the FP8 path several times more, with its casts), and with one local expert its step was
longer than its GPU time by the host's launching alone (cProfile: `JITFunction.run` most of
the host's time a call).

`launch` keeps what the binder computes and drops the rest. The arguments are still bound and
specialised by Triton's own binder (`create_function_from_signature`, the C specialiser), so
the key under which a compiled kernel is kept is exactly Triton's specialisation (dtypes,
16-byte alignment, the integers Triton specialises, constexprs), plus the Python type of
every argument (a constexpr True and 1 are one key to Triton's `==` but not to its compiler)
and the options (warps, stages). A key seen before launches the compiled kernel it found the
first time, straight through its launcher (`CompiledKernel.run`, as `JITFunction.run` ends);
a new key goes through `kernel[grid]` once, which compiles (or finds in Triton's own cache),
launches, and hands back the compiled kernel to keep. So nothing launches that Triton would
not have launched for the same arguments; a pointer that lost its alignment, a new dtype, a
new tile is a new key.

Not done here, so done through `kernel[grid]`: the interpreter (TRITON_INTERPRET=1, CPU
tensors), kernels with pre-run hooks, arguments that cannot be a dictionary key. Triton reads
TRITON_DEBUG and the instrumentation mode once, at import; they are part of its key but do not
change within a process, so they are not part of this one. `through_triton()` turns the cache
off, to compare the two paths (benchmarks/custom_grouped_host_time.py).
"""

import contextlib

from triton import knobs
from triton.runtime.jit import JITFunction

_compiled: dict = {}  # (kernel, device, key) -> CompiledKernel
_binders: dict = {}  # (kernel, device) -> Triton's argument binder for that device's backend
_device_and_stream = None  # Triton's driver's current device and stream getters
_direct = True


def launch(kernel, grid: tuple, *args, **kwargs):
    """kernel[grid](*args, **kwargs) for a grid of one to three ints, and its compiled kernel:
    through Triton the first time a specialisation is seen, straight through its launcher
    afterwards."""
    if not (_direct and isinstance(kernel, JITFunction)) or kernel.pre_run_hooks:
        return kernel[grid](*args, **kwargs)
    current_device, current_stream = _device_and_stream or _driver_getters()
    device = current_device()
    binder = _binders.get((kernel, device)) or _binder(kernel, device)
    key, values = _key_and_values(kernel, device, binder, args, kwargs)
    try:
        compiled = _compiled.get(key)
    except TypeError:  # an argument that cannot be hashed (a list constexpr): Triton's own way
        return kernel[grid](*args, **kwargs)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None:
            _compiled[key] = compiled
        return compiled
    stream = current_stream(device)
    size = len(grid)
    compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, compiled.launch_metadata(grid, stream, *values),
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
    return compiled


def current_stream(device_index: int) -> int:
    """The raw handle of the device's current CUDA stream, the one a launch runs on, read as
    Triton reads it (torch.cuda.current_stream makes a Stream object under a device switch,
    several times the cost, and the host pays it per launch)."""
    return (_device_and_stream or _driver_getters())[1](device_index)


def binder_for(kernel, backend):
    """Triton's argument binder of `kernel` for `backend`: (bound arguments, specialisation,
    options) of a call, as `JITFunction.run` binds them."""
    # Triton's launcher internals, imported here so that a plain import never depends on them.
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(kernel.signature, kernel.params, backend)


def cache_key(kernel, device, binder, *args, **kwargs) -> tuple:
    """The key `launch` keeps the compiled kernel of this call under."""
    return _key_and_values(kernel, device, binder, args, kwargs)[0]


def _key_and_values(kernel, device, binder, args, kwargs):
    """(key, the bound arguments' values in the kernel's order). Flat: a kernel's parameters
    are fixed in number, so the specialisation, the types and the options cannot run into
    each other."""
    bound, specialization, options = binder(*args, **kwargs)
    values = tuple(bound.values())
    return (kernel, device, *specialization, *map(type, values), *options.items()), values


def cached() -> int:
    """How many compiled kernels `launch` holds (a test counts the new ones)."""
    return len(_compiled)


@contextlib.contextmanager
def through_triton():
    """Every launch inside goes through `kernel[grid]`, Triton's own dispatch."""
    global _direct
    before, _direct = _direct, False
    try:
        yield
    finally:
        _direct = before


def _driver_getters():
    global _device_and_stream
    from triton.runtime import driver

    _device_and_stream = (driver.active.get_current_device, driver.active.get_current_stream)
    return _device_and_stream


def _binder(kernel, device):
    from triton.compiler import make_backend
    from triton.runtime import driver

    binder = _binders[(kernel, device)] = binder_for(kernel, make_backend(driver.active.get_current_target()))
    return binder
