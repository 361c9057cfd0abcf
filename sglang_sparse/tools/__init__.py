"""Command-line tools shipped with sglang-sparse (model builder)."""
