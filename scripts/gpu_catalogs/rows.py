"""`rows`, few rows per expert: custom_grouped's few-rows tables, the FP8 tier's break-even,
batch-1 decoding (one GPU each)."""

from gpu_catalogs.launch import Launch, gemm_tiles, pytest_gpu

FEW_ROWS_GRID = ("-m", "benchmarks.custom_grouped_grid", "--tokens", "16,32,64,128,256,512,1024", "--splits", "uniform",
                 "--tiles", "previous")
ROWS_RUNS = {
    # the BF16 grid at 16-1024 rows per expert over 1-8 local experts, both families: step time
    # (host included) and GPU time against TE and grouped_mm, the floors, and the tables before
    # the few-rows ones beside; then where the op's host time goes at one and two experts
    "few-rows": [*(Launch(f"grid-{family}", 1, (*FEW_ROWS_GRID, "--family", family, "--json",
                                                  f"{{out}}/grid-{family}.json"), tail=40) for family in ("8x7b", "8x22b")),
                 Launch("host-time", 1, ("-m", "benchmarks.custom_grouped_host_time", "--cases", "1x16,1x64,2x64",
                                         "--tiles", "previous", "--cprofile"), tail=60)],
    # the BF16 grid at 16-1024 rows per expert over 1-8 local experts, both families, with every
    # other expert tier beside ours as a training step calls it (loop, grouped_linear with its
    # host sync, device_mxfp8 with its run defaults: BF16 kernels under its break-even)
    "few-rows-tiers": [Launch(f"grid-tiers-{family}", 1, (
        "-m", "benchmarks.custom_grouped_grid", "--tokens", "16,32,64,128,256,512,1024", "--splits", "uniform",
        "--family", family, "--json", f"{{out}}/grid-tiers-{family}.json"), tail=60) for family in ("8x7b", "8x22b")],
    # custom_grouped's CUDA tests (accuracy against float64 at every table, CUDA graphs, no host sync)
    "few-rows-tests": pytest_gpu("custom-grouped-tests", "-m", "cuda", "tests/gpu/test_custom_grouped_gpu.py"),
    # device_mxfp8 against custom_grouped by rows per local expert, its default fallback included
    "fp8-break-even": [Launch("fp8-break-even", 1, ("-m", "benchmarks.fp8_break_even", "--json",
                                                    "{out}/fp8_break_even.json"))],
    # the two tiers' CUDA tests, then host / GPU / op ms a fwd+bwd at 1-8 local experts and
    # where the host's time goes (cProfile)
    "launch": [*pytest_gpu("launch-tests", "-m", "cuda", "tests/gpu/test_custom_grouped_gpu.py",
                           "tests/gpu/test_device_mxfp8_gpu.py"),
               Launch("host-time-launch", 1, ("-m", "benchmarks.custom_grouped_host_time", "--cases",
                                              "1x16,1x64,2x64,8x16", "--cprofile"), tail=60)],
    # where FP8's time goes at one local expert (8x7B, 64, 512 and 1024 rows), each step ending in an
    # empty optimizer step as fp8_break_even times it: kernel table, GPU idle time, host cProfile,
    # beside BF16
    "fp8-profile": [Launch("fp8-profile", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases",
                                              "1x64,1x512,1x1024", "--ops", "custom_grouped,device_mxfp8",
                                              "--optimizer-step", "--json", "{out}/fp8_profile.json"), tail=40)],
    # the 8x22B points where a peer's GPU time beat ours in the few-rows grid (its results page lists
    # them): the kernel tables of ours, TE and grouped_mm side by side
    "misses-8x22b": [Launch("misses-8x22b", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases",
                                                "8x32,4x64,8x64,1x128,2x128,4x128,8x128,2x256,4x256,1x512", "--ops",
                                                "custom_grouped,TE,grouped_mm", "--json",
                                                "{out}/misses_8x22b.json"), tail=40)],
    # the few-rows grid's points still missed without a measured cause, each GEMM of ours, TE and
    # grouped_mm against its own bytes and FLOPs, with its grid (op_profile's GEMM table): 8x7B
    # 64 x 8 and 128 x 2, where a peer's GPU time beat ours, and the points of 64-256 rows over 2-8
    # experts above 1.3x the bandwidth floor, with ours' tables beside where they differ: the ones
    # before the few-rows tables, the 128-row one, and the few-rows one of 64 rows (which ran
    # 128 x 2 in the grid); 8x22B 512 x 2 and x 8 and two of its floor misses
    "misses-causes": [
        Launch("misses-causes-8x7b", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases",
                                         "8x64,2x128,2x64,4x64,4x128,8x128,2x256", "--ops", "custom_grouped,TE,grouped_mm",
                                         "--tiles", "previous", "--tiles", "medium, few rows", "--tiles", "few rows, 64",
                                         "--json", "{out}/misses_causes_8x7b.json"), tail=40),
        Launch("misses-causes-8x22b", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases",
                                          "2x512,8x512,4x64,8x128", "--ops", "custom_grouped,TE,grouped_mm", "--json",
                                          "{out}/misses_causes_8x22b.json"), tail=40)],
    # 65-128 rows over 2-3 experts, where the op now runs the "two row tiles" table: the grid
    # beside the few-rows table of 64 rows it ran there before, both families
    "two-row-tiles": [Launch(f"two-row-tiles-{family}", 1, (
        "-m", "benchmarks.custom_grouped_grid", "--family", family, "--experts", "2,3", "--tokens", "96,128",
        "--splits", "uniform,skewed", "--tiles", "few rows, 64", "--json", f"{{out}}/two_row_tiles_{family}.json"),
        tail=30) for family in ("8x7b", "8x22b")],
    # 8x22B, 2 experts of 512 rows, where the grid and the profile disagreed on which op is faster:
    # the grid's point three times over, then its kernel profile
    "point-8x22b-2x512": [*(Launch(f"point-8x22b-2x512-grid{n}", 1, (
        "-m", "benchmarks.custom_grouped_grid", "--family", "8x22b", "--experts", "2", "--tokens", "512",
        "--splits", "uniform", "--json", f"{{out}}/point_8x22b_2x512_grid{n}.json"), tail=20) for n in (1, 2, 3)),
        Launch("point-8x22b-2x512-profile", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases", "2x512",
                                                "--ops", "custom_grouped,TE,grouped_mm", "--json",
                                                "{out}/point_8x22b_2x512_profile.json"), tail=40)],
    # the two weight gradients alone at the floor misses' points (8x7B), each tile candidate of
    # their table beside it (those that hold more programs an SM among them), checked against
    # torch, cuBLAS and grouped_mm, each with its bytes floor; last the picks
    "wgrad-tiles": [gemm_tiles("wgrad-tiles", "2x64,4x64,8x64,2x128,4x128,8x128,2x256", "--gemms",
                               "down_wgrad,gate_up_wgrad")],
    # the 64-row table's weight-gradient tile where the sweep above did not time it: one expert
    # of 65-128 rows, which the same table serves, beside the cases it was picked on
    "wgrad-one-expert": [gemm_tiles("wgrad-one-expert", "1x64,1x96,1x128,2x64,4x64,8x64", "--gemms",
                                    "down_wgrad,gate_up_wgrad")],
    # the grid's missed points that misses-causes did not profile, per GEMM
    "misses-rest": [
        Launch("misses-rest-8x7b", 1, ("-m", "benchmarks.op_profile", "--family", "8x7b", "--cases",
                                       "1x16,2x16,1x32,2x32,1x64,1x128,1x256,4x256,8x256,1x512,2x512,4x512,8x512",
                                       "--ops", "custom_grouped,TE,grouped_mm", "--json", "{out}/misses_rest_8x7b.json"),
               tail=40),
        Launch("misses-rest-8x22b", 1, ("-m", "benchmarks.op_profile", "--family", "8x22b", "--cases",
                                        "1x16,2x16,1x32,8x32,1x64,2x64,8x64,1x128,2x128,4x128,1x256,2x256,4x256,8x256,"
                                        "1x512,4x512", "--ops", "custom_grouped,TE,grouped_mm", "--json",
                                        "{out}/misses_rest_8x22b.json"), tail=40)],
    # generation's GPU tests (graphed tokens equal eager ones), then greedy batch-1 decoding of
    # the whole 8x7B beside transformers' generate and the bandwidth floor
    "decode": [*pytest_gpu("generate-tests", "-m", "cuda", "tests/gpu/test_generate_gpu.py"),
               Launch("decode-b1", 1, ("-m", "benchmarks.decode_b1", "--json", "{out}/decode_b1.json"), tail=40)],
}
