"""The GPU runs as data, which scripts/gpu_runs.py launches: a catalog maps a run's name to the
processes it starts (a list of `Launch`), each run's comment saying what it is for.

    launch.py   Launch and Note, what every catalog is made of, and the builders several share
    tiers.py    the tier sweeps (`tiers`), and `check` and `multi`, built from them
    depth.py    `depth`: a rank's share of the full Mixtral-8x7B, its peers, the full model
    lora.py     `lora`: LoRA over the BF16, FP8 and NF4 bases, beside its peers
    rows.py     `rows`: few rows per expert, the FP8 tier's break-even, batch-1 decoding

Imports go downward only: the catalogs import launch.py, gpu_runs.py imports the catalogs.
"""
