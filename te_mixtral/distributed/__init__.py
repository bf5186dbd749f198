"""How ranks are laid out and how tokens, gradients and state travel between them.

Shape suffixes: see te_mixtral/__init__.py.

    launcher_env.py   what the launcher tells each process, read without torch: world
                      size, rank, launch id and restarts
    launcher_death.py a rank ends with the launcher that started it (Linux's parent-death
                      signal), which torch's own sessions for each rank would not
    layout.py         process groups for expert parallelism, and the gradient reduction
                      they imply
    dispatch.py       token dispatch: each routed token copy to the rank that owns its
                      expert, and back
    placement.py      which experts each EP rank holds: in order, or placed by the
                      load an earlier run recorded, so that the busiest rank has less
    te_permute.py     the local permute of dispatch with Transformer Engine's MoE kernels
    overlap.py        gradient sums overlapped with the backward (`train.sharding: none`)
    parallelize.py    FSDP2 sharding of parameters, gradients and optimizer state
                      (`train.sharding: fsdp`)
    global_state.py   weights and optimizer state as global tensors, so a checkpoint
                      resumes on another world size, EP size or sharding
"""
