"""What a run costs, measured, and how it is reported (its memory estimate: planning/).

    model_state.py   the parameters, gradients and optimizer state each rank holds
    capacity.py      what one rank may use, held against planning/memory.py's estimate
    metrics.py       a step's FLOPs, time, tokens/s and MFU against the hardware
    phases.py        where a step's time goes, phase by phase (--profile_phases)
    expert_load.py   how evenly the router spread a step's tokens over experts and ranks
    loss_check.py    does a run train like its reference: per-step loss, named tolerances
    run_log.py       the run as it goes: a JSON line per step, the trackers, progress bar
    trackers.py      experiment trackers (report_to): TensorBoard, Weights & Biases, MLflow
    report.py        a run's results printed for a terminal and saved for the next run
    plots.py         the pictures of a run and of a results page
"""
