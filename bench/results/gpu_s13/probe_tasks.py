"""The CPU probe of cpu_probes.md: a few harness tasks against one loopserve server per config.

    OMP_NUM_THREADS=1 .venv/bin/python bench/results/gpu_s13/probe_tasks.py \
        '{"b64": {"min_context": 128, "budget": 64, "alpha": 0.97}}' [TASK_ID ...]
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from bench import tasks as T  # noqa: E402
from bench.client import run_conversation  # noqa: E402
from bench.server import Server, ServerSpec  # noqa: E402

ids = sys.argv[2:] or ["recall-begin-w40-s3", "recall-middle-w40-s6", "recall-middle-w40-s7", "multidoc-middle-w30-d3-s8"]
allt = {t.task_id: t for t in T.generate("cpu")}
for name, cfg in json.loads(sys.argv[1]).items():
    spec = ServerSpec(python=sys.executable, model=str(REPO / "models" / "SmolLM2-135M-Instruct"), device="cpu",
                      port=30311, mode="loopserve", sparse_config=json.dumps(cfg))
    with Server(spec, Path(f"/tmp/probe_{name}.log"), timeout_s=300, log=lambda *a: None) as s:
        for i in ids:
            recs = run_conversation(s.url, allt[i], "default", 24)
            print(name, i, [r["reply"][:12] for r in recs], flush=True)
