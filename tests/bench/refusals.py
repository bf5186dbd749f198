"""Running a benchmark's `main` on bad arguments, in a fresh process: what each call returns
and prints, and which heavy modules it imported before refusing (none, if it refused at once)."""

import ast
import subprocess
import sys

from conftest import REPO


def refusals(module: str, argument_lists: list[list[str]], heavy: tuple[str, ...]):
    """([(exit code, stderr)] per argument list, sorted names of `heavy` that were imported)."""
    script = ("import contextlib, io, sys\n"
              f"from benchmarks.{module} import main\n"
              f"for args in {argument_lists!r}:\n"
              "    err = io.StringIO()\n"
              "    with contextlib.redirect_stderr(err):\n"
              "        code = main(args)\n"
              "    print(code, repr(err.getvalue()))\n"
              f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n")
    probe = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                           check=False)
    lines = probe.stdout.splitlines()
    assert len(lines) == len(argument_lists) + 1, probe.stdout + probe.stderr
    answers = [(int(code), ast.literal_eval(stderr)) for code, stderr in (line.split(" ", 1) for line in lines[:-1])]
    return answers, ast.literal_eval(lines[-1])
