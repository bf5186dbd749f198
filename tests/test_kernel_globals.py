"""Every Triton kernel reads module globals only as `tl.constexpr`.

Triton's interpreter, which runs the kernels in the CPU tests, reads any global; the compiler
refuses a plain one ("Cannot access global variable ... from within @jit'ed function") the
first time the kernel runs on a GPU. This test finds such a read without a GPU: every name a
jitted function loads from its module must be a module, another jitted function, a constexpr
or something else the compiler resolves, never a plain number, string or tuple.
"""

import ast
import importlib
import inspect
import pkgutil

import pytest
import triton

import te_mixtral

PLAIN = (bool, int, float, str, tuple, list, dict)


def kernel_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(te_mixtral.__path__, "te_mixtral."):
        spec = importlib.util.find_spec(info.name)
        if spec.origin and spec.origin.endswith(".py") and "triton.jit" in open(spec.origin).read():
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", kernel_modules())
def test_jitted_functions_read_no_plain_globals(name):
    module = importlib.import_module(name)
    jitted = {attr: fn for attr, fn in vars(module).items()
              if isinstance(fn, triton.runtime.JITFunction) and fn.fn.__module__ == name}
    assert jitted, f"{name} mentions triton.jit but defines no kernel"
    plain = []
    for attr, fn in jitted.items():
        tree = ast.parse(inspect.getsource(fn.fn).lstrip())
        arguments = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in arguments | assigned
                    and isinstance(vars(module).get(node.id), PLAIN)):
                plain.append(f"{attr} reads {node.id} = {vars(module)[node.id]!r}")
    assert not plain, f"{name}: plain globals in kernels (wrap them in tl.constexpr): {plain}"
