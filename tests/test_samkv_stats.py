"""Contract: the samkv server counters say why documents requests were served by the dense fallback, with a
bounded number of distinct reasons."""

from sglang_sparse.samkv.stats import SamKVStats


def test_fallback_reasons_are_counted_and_bounded():
    st = SamKVStats()
    st.record({"status": "assembled", "document_tokens": 100, "kept_tokens": 20})
    for _ in range(3):
        st.record({"status": "fallback", "reason": "document not cached"})
    st.record({"status": "fallback", "reason": "no free KV slots for the composite"})
    st.record({"status": "error", "reason": "RuntimeError"})
    st.record({"status": "fallback"})
    d = st.to_dict()
    assert d["by_status"]["fallback"] == 5 and d["by_status"]["error"] == 1
    assert d["fallback_reasons"] == {"document not cached": 3, "no free KV slots for the composite": 1,
                                     "RuntimeError": 1, "fallback": 1}
    assert d["kv_kept_ratio"] == 0.2
    for i in range(100):
        st.record({"status": "fallback", "reason": f"reason {i}"})
    assert len(st.fallback_reasons) == 32
