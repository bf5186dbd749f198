"""te_mixtral: fine-tune Mixtral-style MoE models with expert parallelism, tier by tier."""
