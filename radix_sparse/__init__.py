"""radix_sparse: per-node sparse metadata for the radix cache, document entries and the host
tier (pure torch/python; never imports sglang). Filled in by the mode issues."""
