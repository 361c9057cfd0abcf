"""``--sparse psa``: PSA progressive threshold decode (PSA Alg. 1) as an SGLang attention backend.

Modules: ``backend`` (the backend wrapper installed into SGLang), ``runner`` (the CPU reference and CUDA kernel
runners), ``stats`` (per-step rows, /server_info and /metrics). No import at package import time.
"""
