"""The Pallas kernels against their references, their lowering and sm_90a compile check, the pallas backend."""
