"""Compiling a kernel launch for a GPU that is not here, to read what it would take.

Triton compiles a kernel at its first launch, for the GPU it launches on, and only then
learns whether the tile fits: a configuration that asks more shared memory per block than
that GPU has fails there (`OutOfResources`), however well it ran on another. `launch` runs a
launch as usual, or, given a target such as `GPUTarget("cuda", 80, 32)` (sm_80), compiles
that same launch for it without a GPU: its arguments bound and specialised as Triton's own
launcher binds them (dtypes, 16-byte alignment, the integers it specialises, constexprs),
through that launcher's binder (`triton.runtime.jit`). The compiled kernel's
`metadata.shared` is the shared memory the launch would ask for, and its SASS
(`asm["cubin"]`) shows any register spills. The grouped GEMMs' launchers take such a target,
so a CPU test checks the tiles a tier can pick on every GPU it claims
(tests/experts/test_kernel_resources.py: each table's heaviest, or every tile).
"""

import triton
from triton.backends.compiler import GPUTarget


def launch(kernel, programs: int, target: GPUTarget | None, *args, **kwargs):
    """kernel[(programs,)](*args, **kwargs) and its compiled kernel; with a target, the
    compiled kernel for it alone (nothing runs)."""
    if target is None:
        return kernel[(programs,)](*args, **kwargs)
    return compiled_for(target, kernel, *args, **kwargs)


def compiled_for(target: GPUTarget, kernel, *args, **kwargs):
    """`kernel` compiled for `target` as a launch with these arguments would compile it."""
    # Triton's launcher internals, imported here so that a launch never depends on them.
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
