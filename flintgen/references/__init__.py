"""fp32/fp64 torch references for every kernel (cute-free)."""
