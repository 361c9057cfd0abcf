"""flashinfer_ext: kernels and their fp32 torch references (FlashInfer where it fits, Triton
where it does not); never imports sglang. Filled in by the mode issues."""
