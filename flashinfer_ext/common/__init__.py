"""Kernels shared by the modes: list-driven decode tiles (``tile_attention``), sparse-page decode
(``sparse_decode``, ``split_decode``), log-sum-exp merge (``merge``), FlashInfer dense decode
(``dense_decode``) and the fp32 torch references (``reference``)."""
