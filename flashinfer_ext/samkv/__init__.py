"""SamKV kernels: block scoring (``score``) and RoPE re-rotation of reused document keys (``rope_shift``)."""
