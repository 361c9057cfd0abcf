"""End-to-end CPU test of the measuring harness: the real driver starts a real dense
SGLang server on the default model, runs the ``tiny`` preset through the OpenAI API
(multi-turn tasks as real conversations) and writes the report.

Checks: report files exist and state command/machine/versions/model/dtype; the dense
baseline answers the generator's own ground truth on the trivially short contexts (all
needles, all first turns of recall tasks), the headline equals the raw scores;
later turns reuse the radix cache; ``baseline_dense.json`` has the promised schema.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
PORT = int(os.environ.get("BENCH_TEST_PORT", "32050"))


@pytest.mark.server
def test_tiny_preset_end_to_end(tmp_path):
    if not MODEL.is_dir():
        pytest.skip(f"default model not built at {MODEL} (python -m sglang_sparse.tools.build_model)")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    # generous limits (a loaded 2-core machine starts the CPU server slowly); past them the driver gets SIGTERM,
    # on which it stops its server (a SIGKILL, subprocess.run's timeout, would leave the server running)
    p = subprocess.Popen([sys.executable, "-m", "bench.run_harness", "--preset", "tiny", "--device", "cpu",
                          "--port", str(PORT), "--out", str(out), "--server-timeout", "360"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        p.terminate()
        stdout, stderr = p.communicate(timeout=90)
        pytest.fail(f"driver still running after 420 s (stopped):\n{stdout[-3000:]}\n{stderr[-3000:]}")
    wall = time.monotonic() - t0
    assert p.returncode == 0, f"driver failed ({wall:.0f}s):\n{stdout[-3000:]}\n{stderr[-3000:]}"

    for name in ("report.md", "accuracy_by_position.png", "latency.png", "summary.json", "baseline_dense.json",
                 "raw/off.json", "logs/off.log"):
        assert (out / name).is_file(), f"missing {name}"
    md = (out / "report.md").read_text()
    for key in ("- command:", "- machine:", "- versions:", "sglang 0.5.17", "- model:", "- dtype: bfloat16",
                "## Headline accuracy by question position", "## Fidelity against dense", "## Latency"):
        assert key in md, f"report lacks {key!r}"

    # Dense must answer what the generator planted, on these trivially short contexts:
    # every single-turn needle, and every first turn of a recall task (its own fact,
    # question last). Multi-document and second-turn questions are scored, not required.
    raw = json.loads((out / "raw" / "off.json").read_text())
    assert raw["server"]["sparse"] == "off"
    assert len(raw["tasks"]) == 12 and all(t["turns"] and not t["error"] for t in raw["tasks"])
    must = [(t["task_id"], t["turns"][0]) for t in raw["tasks"] if t["kind"] in ("needle", "recall")]
    assert len(must) == 9
    wrong = [(tid, x["reply"], x["answers"]) for tid, x in must if x["score"] < 1.0]
    assert not wrong, f"dense missed planted answers on trivially short contexts: {wrong}"
    for t in raw["tasks"]:  # the scorer agrees with plain containment of the ground truth
        for x in t["turns"]:
            found = all(re.search(rf"(?<!\d){a}(?!\d)", x["reply"]) for a in x["answers"])
            assert x["score"] == float(found), (t["task_id"], x)

    # Multi-turn tasks were real conversations: the second turn reused the first's KV.
    later = [x for t in raw["tasks"] for x in t["turns"] if x["turn"] > 0]
    assert later and all((x["cached_tokens"] or 0) > 100 for x in later), later

    base = json.loads((out / "baseline_dense.json").read_text())
    assert set(base) == {"gpu", "model", "dtype", "tasks", "accuracy_by_position"}
    assert base["model"] == "SmolLM2-135M-Instruct" and base["dtype"] == "bfloat16" and base["tasks"] == 12
    acc = base["accuracy_by_position"]
    assert set(acc) == {"begin", "middle", "end"} and all(0.5 <= v <= 1.0 for v in acc.values()), acc
    # the headline equals the last-turn scores recomputed from the raw records
    for pos, v in acc.items():
        last = [t["turns"][-1]["score"] for t in raw["tasks"] if t["position"] == pos]
        assert v == pytest.approx(sum(last) / len(last), abs=1e-4)


def test_fidelity_probes_option_is_parsed_and_checked():
    from bench.run_harness import parse_args
    assert parse_args(["--fidelity-probes", "4"]).fidelity_probes == 4
    assert parse_args([]).fidelity_probes is None
    with pytest.raises(SystemExit):
        parse_args(["--fidelity-probes", "-1"])
