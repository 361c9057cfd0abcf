"""Contract of bench.overlap_runs: a stalled server is found by its log's silence, a crash by its CUDA error line,
the served task count by the driver's last [tasks] line, and soak facts lost / won against off by traffic kind."""

from __future__ import annotations

import json

import pytest

from bench.overlap_runs import main, server_log_summary, soak_flips
from bench.soak import CYCLE

HEALTHY = """[2026-11-29 15:03:40] Load weight end.
[2026-11-29 15:03:58] INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 200 OK
[2026-11-29 15:04:00] Decode batch, #running-req: 3
[2026-11-29 15:04:05] sglang-sparse samkv: abc assembled timing_ms={'total': 3.0}
"""
STALLED = HEALTHY + """[2026-11-29 15:04:18] Prefill batch, #new-seq: 1
[2026-11-29 15:06:02] Scheduler hit an exception: Traceback (most recent call last):
torch.AcceleratorError: CUDA error: an illegal memory access was encountered
[2026-11-29 15:06:07] kill_process_tree called
"""


def _run(tmp_path, logs: dict[str, str], driver: str):
    (tmp_path / "logs").mkdir(parents=True)
    for mode, text in logs.items():
        (tmp_path / "logs" / f"{mode}.log").write_text(text)
    (tmp_path / "driver.log").write_text(driver)
    return tmp_path


def test_stall_length_and_crash_come_from_the_server_log(tmp_path):
    stalled = tmp_path / "s.log"
    stalled.write_text(STALLED)
    healthy = tmp_path / "h.log"
    healthy.write_text(HEALTHY)
    s = server_log_summary(stalled)
    assert (s["illegal_memory_access"], s["longest_silence_s"], s["silence_from"], s["assembled"]) == \
        (True, 104.0, "15:04:18", 1)
    h = server_log_summary(healthy)
    assert (h["illegal_memory_access"], h["longest_silence_s"]) == (False, 5.0)  # start-up before the first request


def test_report_names_served_and_failed_tasks_per_mode(tmp_path):
    driver = ("15:04:14 [off] [tasks] 22/330 done in 15s, last-turn score so far 0.23, 0 failed\n"
              "15:06:08 [samkv] [tasks] 330/330 done in 129s, last-turn score so far 0.47, 298 failed\n"
              "15:07:56 [off] [tasks] 330/330 done in 237s, last-turn score so far 0.32, 39 failed\n")
    run = _run(tmp_path / "run", {"off": HEALTHY, "samkv": STALLED}, driver)
    out = tmp_path / "rep"
    assert main(["--run", "A", str(run), "--setting", "A", "overlap on", "--gpu", "G", "--out", str(out),
                 "--note", "a reading"]) == 0
    rep = json.loads(out.with_suffix(".json").read_text())
    modes = rep["runs"]["A"]["modes"]
    assert (modes["off"]["served"], modes["off"]["failed"]) == (291, 39)
    assert (modes["samkv"]["served"], modes["samkv"]["illegal_memory_access"]) == (32, True)
    md = out.with_suffix(".md").read_text()
    assert "| A | overlap on | samkv | 32 / 330 | 298 | 104 | yes | 1 |" in md and "a reading" in md


def test_soak_facts_lost_and_won_are_split_by_the_items_kind():
    chat = next(i for i, k in enumerate(CYCLE) if k == "chat")
    rag = next(i for i, k in enumerate(CYCLE) if k == "rag")
    report = {"modes": {
        "off": {"facts": {str(chat): True, str(rag): False, str(rag + len(CYCLE)): True}},
        "samkv": {"facts": {str(chat): False, str(rag): True, str(rag + len(CYCLE)): True}, "sent": 3,
                  "wrong_vs_off": 1}}}
    row = soak_flips(report, "samkv")
    assert row["lost_vs_off_by_kind"] == {"chat": 1} and row["won_vs_off_by_kind"] == {"rag": 1}
    assert (row["sent"], row["wrong_vs_off"]) == (3, 1)


def test_a_run_folder_without_a_driver_log_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--run", "A", str(tmp_path), "--gpu", "G", "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "has no driver.log" in capsys.readouterr().err
