"""PSA decode kernels: block metadata, criticality, ranking, split-K chunks, wave merge with the stop test,
and :class:`~flashinfer_ext.psa.decode.PsaDecodeWrapper` (plan() once per batch, run() per layer).
"""
