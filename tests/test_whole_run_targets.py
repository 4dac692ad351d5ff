"""benchmarks/vllm_gpu/whole_run_targets.py: the whole run's targets judged from the files its
steps bring back (results.tgz and whole_run.json a step), on made-up runs whose every number is
set here: the whole grid at 0.97 and 0.95 in two rounds meets every target, and each way one
target can be missed (a cell over, a run, cell or step not measured, a failed command, a test
skipped, too long in all) misses it, by name."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

TESTS_PASSED = "======================== 4 passed in 41.20s ========================\n"
GRID = [(tokens, lead, mode) for tokens in (1, 16, 256, 4096) for lead in (1, 4, 12)
        for mode in ("pipelined", "synced")]
ROUNDS = (0.97, 0.95)  # every decode cell's two rounds, but where a test sets others
PREFILL_ROUNDS = (0.72, 0.70)  # and every T = 4096 cell's


def pack(step_dir: Path, files: dict[str, bytes], seconds: int, exit_code: int = 0) -> None:
    """A step's folder as whole_run.sh leaves it: OUT's files packed as ./name, and its record."""
    step_dir.mkdir(parents=True)
    with tarfile.open(step_dir / "results.tgz", "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (step_dir / "whole_run.json").write_text(json.dumps(
        {"step": step_dir.name, "seconds": seconds, "exit": exit_code}))


def report(runs: dict[bool, bool], steps: list[dict]) -> bytes:
    return json.dumps({"meta": {}, "runs": [{"mps": mps, "rows_exact": exact} for mps, exact in runs.items()],
                       "lookups": [], "steps": steps}).encode()


def paired_steps(modes, rounds_of: dict, drop: set) -> list[dict]:
    """--paired cells: each plugin variant's, and vLLM's (its graph for plugin_captured) timed
    beside it at 400 us; served without MPS too (neither held nor shown)."""
    steps = []
    for mps in modes:
        for variant in ("plugin_mapped", "plugin_captured", "plugin_served"):
            partner = "vllm_graph" if variant == "plugin_captured" else "vllm"
            for tokens, lead, mode in GRID:
                key = (mps, variant, tokens, lead, mode)
                if key in drop:
                    continue
                default = ROUNDS if tokens <= 256 else PREFILL_ROUNDS
                for number, ratio in enumerate(rounds_of.get(key, default)):
                    cell = {"mps": mps, "tokens": tokens, "lead": lead, "mode": mode, "round": number}
                    steps += [{**cell, "variant": partner, "beside": variant, "step_us": 400.0},
                              {**cell, "variant": variant, "step_us": 400.0 * ratio}]
    return steps


def unpaired_steps(mps: bool) -> list[dict]:
    """A 64 GiB run's cells, one round: vLLM's phase-1 step and graph, the plugin's own at 0.9x
    them (0.6x at T = 4096)."""
    steps = []
    for tokens, lead, mode in GRID:
        cell = {"mps": mps, "tokens": tokens, "lead": lead, "mode": mode, "round": 0}
        ratio = 0.9 if tokens <= 256 else 0.6
        steps += [{**cell, "variant": "vllm", "step_us": 1000.0},
                  {**cell, "variant": "vllm_graph", "step_us": 500.0},
                  {**cell, "variant": "plugin_mapped", "step_us": 1000.0 * ratio},
                  {**cell, "variant": "plugin_captured", "step_us": 500.0 * ratio}]
    return steps


def whole_run(folder: Path, under_mps_log: str = TESTS_PASSED, rounds_of: dict | None = None,
              drop: frozenset = frozenset(), runs: dict | None = None, exit_code: int = 0,
              seconds_64_on: int = 250) -> Path:
    pack(folder / "tests", {"vllm_gpu.log": TESTS_PASSED.encode(),
                            "mps/vllm_gpu.log": under_mps_log.encode()}, 100)
    for step in ("uniform", "text"):
        modes = (runs or {}).get(step, {False: True, True: True})
        pack(folder / step, {"vllm_bench/bench_lookup.json": report(
            modes, paired_steps(modes, rounds_of or {}, drop))}, 400, exit_code)
    for step, mps in (("64-off", False), ("64-on", True)):
        pack(folder / step, {"vllm_bench/bench_lookup.json": report({mps: True}, unpaired_steps(mps))},
             seconds_64_on if mps else 250)
    return folder


@pytest.fixture
def targets(monkeypatch):
    from test_bench_common import _engine_module
    return _engine_module(monkeypatch, "vllm", "whole_run_targets")


def test_a_run_that_meets_every_target(targets, tmp_path):
    # Served under MPS over 1.00 in every round of one cell: shown, held to nothing. Exactly 1.00
    # meets the target; a median under it with one round over is not over.
    rounds_of = {(True, "plugin_served", 16, 1, "synced"): (1.3, 1.2),
                 (False, "plugin_mapped", 16, 4, "synced"): (1.0, 1.0),
                 (True, "plugin_mapped", 1, 1, "pipelined"): (1.03, 0.95)}
    lines, met = targets.judge(whole_run(tmp_path, rounds_of=rounds_of))
    text = "\n".join(lines)
    assert met, text
    assert "| uniform | on | plugin_served | 1 of 18 | 1 | 1.250 | shown |" in lines, text
    assert "| uniform | off | plugin_mapped | 0 of 18 | 0 | 1.000 | met |" in lines, text
    assert "| uniform | on | plugin_mapped | 0 of 18 | 0 | 0.990 | met |" in lines, text
    assert "| 64-on | on | plugin_captured | 0 of 18 | - | 0.900 | met |" in lines, text
    assert "| uniform | off | plugin_captured | 0.710 | met |" in lines, text  # T = 4096
    assert "| 64-on | on | plugin_mapped | 0.600 | met |" in lines, text
    assert not any("| off | plugin_served |" in line for line in lines), "served without MPS: not shown"
    assert "- in all: 1400 s (23.3 min), not counting the machine's start: met" in lines


@pytest.mark.parametrize("change, missed", [
    ({"rounds_of": {(False, "plugin_mapped", 256, 12, "synced"): (1.02, 1.01)}},
     "| uniform | off | plugin_mapped | 1 of 18 | 1 | 1.015 | **missed** |"),
    ({"rounds_of": {(True, "plugin_captured", 16, 1, "pipelined"): (1.03, 0.99)}},
     "| uniform | on | plugin_captured | 1 of 18 | 0 | 1.010 | **missed** |"),
    ({"rounds_of": {(False, "plugin_captured", 4096, 1, "synced"): (0.85, 0.85)}},
     "| uniform | off | plugin_captured | 0.850 | **missed** |"),
    ({"drop": frozenset({(True, "plugin_captured", 4096, 4, "pipelined")})},
     "- uniform, MPS on, plugin_captured: 1 of 24 cells not measured: **missed**"),
    ({"runs": {"text": {False: True}}}, "- text, under MPS: rows no run: **missed**"),
    ({"runs": {"text": {False: True, True: False}}}, "- text, under MPS: rows NOT exact: **missed**"),
    ({"exit_code": 1}, "- uniform: 400 s, exit 1: **missed**"),
    ({"under_mps_log": "=== 3 passed, 1 skipped in 9.00s ===\n"},
     "- GPU tests under MPS: 3 passed, 1 skipped in 9.00s: **missed**"),
    ({"under_mps_log": "=== 1 passed, 3 deselected in 9.00s ===\n"},
     "- GPU tests under MPS: 1 passed, 3 deselected in 9.00s: **missed**"),
    ({"under_mps_log": "collected 4 items\n"}, "- GPU tests under MPS: no summary line (stopped?): **missed**"),
    ({"seconds_64_on": 651}, "- in all: 1801 s (30.0 min), not counting the machine's start: **missed**"),
])
def test_a_missed_target_is_named_and_fails_the_run(targets, tmp_path, change, missed):
    lines, met = targets.judge(whole_run(tmp_path, **change))
    assert missed in lines, "\n".join(lines)
    assert not met and lines[-1] == "Every target: **missed**"


def test_a_step_not_run_misses_and_its_seconds_are_not_counted(targets, tmp_path):
    folder = whole_run(tmp_path)
    for path in (folder / "text").iterdir():
        path.unlink()
    lines, met = targets.judge(folder)
    assert not met
    assert "- text: no bench_lookup.json: **missed**" in lines
    assert "- text: not run (no whole_run.json): **missed**" in lines
    assert "- in all: 1000 s (16.7 min), not counting the machine's start: met" in lines


def test_the_recipe_lists_the_steps_the_targets_read_and_refuses_another(targets, tmp_path):
    script = Path(targets.__file__).with_name("whole_run.sh")
    listed = subprocess.run(["bash", str(script), "--list"], capture_output=True, text=True,
                            check=True, timeout=30).stdout
    assert tuple(line.split()[0] for line in listed.splitlines()[:-1]) == targets.STEPS, listed
    for wrong in (["64"], ["tests uniform"], ["tests", "uniform"]):
        refused = subprocess.run(["bash", str(script), str(tmp_path / "out"), *wrong],
                                 capture_output=True, text=True, timeout=30)
        assert refused.returncode == 2 and "usage" in refused.stderr, (wrong, refused)
    assert not (tmp_path / "out").exists(), "nothing ran"
