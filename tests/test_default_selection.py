"""What `python -m pytest -q` leaves out: the tests marked slow, and only those, so that the suite
fits its time on a 2-core machine (tests/README.md); `--runslow` collects them all, a test named
by its id runs even where it is slow, and a marker expression (`-m cuda`, as the GPU runs pick
their tests) decides alone. Collection only, of a few modules, in one fresh process started with
the session (conftest.py's `planned_command`): each selection a `pytest.main` of its own there,
which records every test it keeps and whether it is marked slow."""

import json
import sys

from background import Command
from launch import RUN_DIR

EP = "tests/distributed/test_ep_gradients.py"
README = "tests/test_readme_commands.py"
NAMED = "tests/training/test_resume.py::test_stop_and_resume_equals_one_run[lora-nf4]"  # a slow one
SELECTIONS = {"default": [EP, README, NAMED], "everything": ["--runslow", EP, README], "slow": ["-m", "slow", EP]}
COLLECT = """import json, sys, pytest

class Kept:
    def pytest_collection_finish(self, session):
        self.tests = {item.nodeid: item.get_closest_marker("slow") is not None for item in session.items}

selections = {}
for name, args in json.loads(sys.argv[1]).items():
    kept = Kept()
    assert pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[kept]) == 0, name
    selections[name] = kept.tests
with open(sys.argv[2], "w") as out:
    json.dump(selections, out)
"""
RUN = Command((sys.executable, "-c", COLLECT, json.dumps(SELECTIONS), f"{RUN_DIR}/selections.json"))
PLANNED_COMMANDS = [RUN]  # run from the session's start (conftest.py's planned_command)


def test_the_default_run_leaves_out_the_slow_tests_and_runslow_collects_them(planned_command):
    proc, folder = planned_command(RUN)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    selections = json.loads((folder / "selections.json").read_text())
    default, everything, slow = selections["default"], selections["everything"], selections["slow"]

    # The default run: the modules' tests but those marked slow, and the slow one named by its id.
    assert default.pop(NAMED) is True
    assert default == {test: False for test, is_slow in everything.items() if not is_slow}
    left_out = [test for test, is_slow in everything.items() if is_slow]
    assert left_out and all(test.startswith(EP) for test in left_out)
    # Of each kind of check, one stays: the EP gradients on two ranks, the README's sequences.
    assert f"{EP}::test_six_experts_top3_ep2" in default
    assert sum(test.startswith(f"{README}::test_readme_launcher_command_runs_as_written") for test in default) >= 4
    # A marker expression picks the tests itself, slow ones too.
    assert set(slow) == set(left_out)
