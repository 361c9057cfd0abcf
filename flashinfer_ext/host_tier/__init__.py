"""Host-tier kernels: fused host<->device transfers (``host_transfer``), KV pages <-> host units
(``kv_units``) and working-set records (``ws_record``)."""
