"""Hand-written GPU kernels (Triton) used by the faster expert tiers."""
