"""The Prometheus exposition of the hot-row cache counters (a GPU daemon's snapshot, built by hand)."""

from __future__ import annotations

import gc

from prometheus_client.exposition import generate_latest

from engramd.server import gc_pauses
from engramd.server.gc_pauses import GcPauses
from engramd.server.job_context import JobContext
from engramd.server.metrics import Metrics


def snapshot(hot_cache: dict) -> dict:
    return {"ready": True, "progress": 1.0, "uptime": 3.0, "epoch": "e", "backend": "cuda",
            "clients": [], "lookups": 0, "rows": 0, "out_of_range": 0, "errors": {},
            "slab_bytes": {}, "pinned_bytes": 0, "hot_cache": hot_cache}


def test_cache_counters_are_exposed_per_gpu_and_layer():
    metrics = Metrics()
    metrics.publish(snapshot({"GPU-a": {"reads": [100, 40], "hits": [25, 10], "hit_rate": [0.25, 0.25],
                                        "bytes_saved": 35 * 264, "admitted": 7, "slots": 1024}}))
    text = generate_latest(metrics.registry).decode()
    assert 'engramd_cache_reads_total{device="GPU-a",layer="0"} 100.0' in text
    assert 'engramd_cache_hits_total{device="GPU-a",layer="1"} 10.0' in text
    assert 'engramd_cache_hit_rate{device="GPU-a",layer="1"} 0.25' in text
    assert f'engramd_cache_bytes_saved_total{{device="GPU-a"}} {35 * 264}.0' in text
    assert 'engramd_cache_slots{device="GPU-a"} 1024.0' in text


def test_no_cache_exposes_empty_families():
    metrics = Metrics()
    metrics.publish(snapshot({}))
    text = generate_latest(metrics.registry).decode()
    samples = [line for line in text.splitlines()
               if line.startswith("engramd_cache_") and not line.startswith("#")]
    assert "# TYPE engramd_cache_hits_total counter" in text and samples == []


def test_mps_state_is_exposed_per_gpu():
    metrics = Metrics()
    metrics.publish({**snapshot({}), "mps": {"GPU-a": {"enabled": True, "server": "1:2"},
                                             "GPU-b": {"enabled": False, "server": ""}}})
    text = generate_latest(metrics.registry).decode()
    assert 'engramd_mps_enabled{device="GPU-a"} 1.0' in text
    assert 'engramd_mps_enabled{device="GPU-b"} 0.0' in text


def test_clients_are_counted_by_mode():
    metrics = Metrics()
    clients = [{"client_id": i, "pid": 1, "name": "", "device": "cpu", "lookups": 0, "rows": 0,
                "mode": mode} for i, mode in enumerate(["served", "mapped", "mapped"])]
    metrics.publish({**snapshot({}), "clients": clients})
    text = generate_latest(metrics.registry).decode()
    assert 'engramd_clients_by_mode{mode="served"} 1.0' in text
    assert 'engramd_clients_by_mode{mode="mapped"} 2.0' in text


def test_the_served_tables_and_clients_still_on_others_are_exposed():
    metrics = Metrics()
    clients = [{"client_id": 1, "device": "cpu", "lookups": 0, "rows": 0, "tables": "new"},
               {"client_id": 2, "device": "cpu", "lookups": 0, "rows": 0, "tables": "old"}]
    metrics.publish({**snapshot({}), "tables": "new", "reload": {"state": "done"}, "clients": clients})
    text = generate_latest(metrics.registry).decode()
    assert 'engramd_tables_info{reload="done",tables="new"} 1.0' in text
    assert "engramd_clients_on_other_tables 1.0" in text


def _gc_series(metrics: Metrics, suffix: str, generation: int, le: str | None = None) -> float:
    text = generate_latest(metrics.registry).decode()
    labels = f'generation="{generation}"' + (f',le="{le}"' if le else "")
    prefix = f"engramd_gc_pause_seconds_{suffix}{{{labels}}} "
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix):])


def test_garbage_collections_are_observed_per_generation_while_installed():
    metrics = Metrics()
    metrics.gc_pauses.install()
    try:
        before = _gc_series(metrics, "count", 2)
        gc.collect()
        gc.collect()
        assert _gc_series(metrics, "count", 2) == before + 2
        assert _gc_series(metrics, "bucket", 2, "+Inf") == before + 2
        assert _gc_series(metrics, "sum", 2) > 0
    finally:
        metrics.gc_pauses.uninstall()
    assert metrics.gc_pauses._observe not in gc.callbacks
    after = _gc_series(metrics, "count", 2)
    gc.collect()
    assert _gc_series(metrics, "count", 2) == after  # no longer observed


def test_a_pause_lands_in_the_first_bucket_at_least_as_long(monkeypatch):
    pauses = GcPauses([0.001, 0.01])
    clock = iter([0.0, 0.0005, 1.0, 1.001, 2.0, 2.005, 3.0, 3.5])
    monkeypatch.setattr(gc_pauses.time, "perf_counter", lambda: next(clock))
    for _ in range(4):
        pauses._observe("start", {"generation": 1})
        pauses._observe("stop", {"generation": 1})
    buckets, seconds = pauses.histogram(1)
    assert buckets == [("0.001", 2), ("0.01", 3), ("+Inf", 4)]
    assert abs(seconds - (0.0005 + 0.001 + 0.005 + 0.5)) < 1e-9
    assert pauses.histogram(0) == ([("0.001", 0), ("0.01", 0), ("+Inf", 0)], 0.0)


def test_a_cpu_lookups_stages_are_observed_from_its_context():
    metrics = Metrics()
    metrics.observe_stages(JobContext(received=1.0, submitted=1.00002, started=1.0003,
                                      enqueued=1.0063, answered=1.5))
    text = generate_latest(metrics.registry).decode()

    def count(stage: str, le: str) -> float:
        prefix = f'engramd_lookup_stage_seconds_bucket{{le="{le}",stage="{stage}"}} '
        return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix):])

    # 20 us, 280 us, 6 ms, 494 ms: each in the first bucket at least as long
    assert (count("submit", "2.5e-05"), count("queue", "0.0002"), count("queue", "0.0004")) == (1, 0, 1)
    assert (count("gather", "0.0064"), count("gather", "0.0032"), count("completion", "0.5")) == (1, 0, 1)
    assert count("completion", "0.2") == 0
