"""A short run of benchmarks/chaos.py for CI: every fault kind once, every row verified.

The long run (benchmarks/chaos.py, results in benchmarks/results/chaos.md) is the real test of
the promise that no fault becomes a wrong row without an error, nothing hangs and nothing leaks;
this one runs one round of its faults (kill -9 and a restart, kill -9 and a standby, a drain and a
restart, a reload, SIGSTOP shorter and longer than the clients' reply timeout) on the demo
tables, so that the script keeps working and a gross failure shows on every change.
"""

from __future__ import annotations

from test_soak_short import load_script

CHAOS_SEED = 3  # any seed meets every kind: the faults come in shuffled rounds of all kinds
# Checks that time the machine: a reply slower than the clients' reply timeout away from every
# fault's window is a loaded CI machine's doing, not a fault's. The long run holds them; here an
# error outside the windows need only be typed ("no untyped errors").
TIMED_CHECKS = {"typed errors only around a fault"}


def test_short_chaos_every_fault_kind_no_wrong_row_no_hang_no_leak(demo_checkpoint,
                                                                    second_checkpoint, tmp_path):
    chaos = load_script("chaos")
    summary = chaos.run(chaos.ChaosConfig(
        seconds=5, clients=4, tables=str(demo_checkpoint), second_tables=str(second_checkpoint),
        seed=CHAOS_SEED, timeout_s=2.0, reconnect_s=20.0, pause_s=(0.3, 1.0), heartbeat_s=0.2,
        workdir=str(tmp_path)))
    failed = [name for name, ok in summary["checks"].items() if not ok and name not in TIMED_CHECKS]
    assert not failed, (failed, summary["problems"], summary["per_kind"], summary["end"])
    assert all(summary["per_kind"][kind]["faults"] >= 1 for kind in chaos.FAULTS)
    assert summary["totals"]["lookups"] > 0 and summary["totals"]["wrong_rows"] == 0
    assert summary["totals"]["tables_checked"] > 0  # lookups of both checkpoints were told apart
