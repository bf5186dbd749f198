"""custom_grouped_gemms.py on the CPU: `--gemms` names GEMMs of the op or is refused, and each
GEMM's cases time the table's tile beside every other candidate of its regime."""

from benchmarks import custom_grouped_gemms as gemms
from benchmarks.custom_grouped_ops import WGRAD_FEW_ROWS
from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS


def test_a_gemm_it_does_not_know_is_refused_before_the_gpu_is_asked(capsys):
    assert gemms.main(["--gemms", "down_wgrad,up_wgrad"]) == 2
    assert "custom_grouped_gemms: error: --gemms takes gate_up, down" in capsys.readouterr().err


def test_the_weight_gradients_time_their_table_and_every_other_candidate():
    """At 64 rows over 4 experts: the few-rows table's weight-gradient tile first, then each
    candidate (their reduction step the rows' 64), the table's own not twice."""
    found = gemms.configs("down_wgrad", [64] * 4)
    assert next(iter(found.items())) == ("table", CONFIGS["few rows, 64"]["down_wgrad"])
    assert list(found.values())[1:] == [dict(c, BLOCK_I=64) for c in WGRAD_FEW_ROWS
                                        if dict(c, BLOCK_I=64) != CONFIGS["few rows, 64"]["down_wgrad"]]
    assert len(set(found)) == len(WGRAD_FEW_ROWS)  # every candidate under a name of its own
