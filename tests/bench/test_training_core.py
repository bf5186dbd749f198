"""benchmarks/training_core.py: what it runs is checked as the app checks it, before any run,
so a bad flag is one line and `--quick`, the CPU check of the script, runs both cores."""

from benchmarks import training_core


def test_quick_asks_only_for_runs_the_app_accepts():
    # Before, --quick ran master_adamw in fp32, which the app refuses: the script's own CPU
    # check could not pass.
    training_core.check_runs(training_core.QUICK_CONFIG, training_core.QUICK_TIERS, training_core.QUICK_ARGS)


def test_a_run_the_app_would_refuse_is_one_line_before_any_run(tmp_path, capsys):
    for argv, fragment in [(["--tiers", "fastest"], "unknown tier 'fastest'"),
                           (["--config", "configs/missing.yaml"], "cannot read config configs/missing.yaml"),
                           (["--quick", "--", "--stpes", "3"], "unknown config key 'stpes'")]:
        assert training_core.main([str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("training_core: error: ") and err.count("\n") == 1 and fragment in err, err
        assert not (tmp_path / "out").exists()  # no run was started, no folder made
