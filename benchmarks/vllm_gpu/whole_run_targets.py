"""The whole run's targets (whole_run.sh), met or missed, from the files its steps brought back.

    python benchmarks/vllm_gpu/whole_run_targets.py DIR [--out FILE.md]

DIR holds a folder per step, named as the step (tests, uniform, text, 64-off, 64-on), each with
the results.tgz and whole_run.json that whole_run.sh wrote. A step that is not there is named
and counts as missed.

The targets, and what each is read from:
- Rows: the GPU tests passed without MPS and under it (`N passed`, nothing failed, errored,
  skipped or deselected: a skip there means no CUDA or no vLLM tree, a deselected test a subset
  of the file), and every benchmark run's rows exact
  (its row checks, the captured lookup's check() and no plugin build that raised).
- Decode, T <= 256: vLLM with engramd at most 1.00x vLLM alone: the plugin as a GPU replica
  gets it, mapped (plugin_mapped against vLLM's eager step, and plugin_captured, its step in a
  CUDA graph, against vLLM's graph), in both MPS modes. plugin_served under MPS (a client that
  asks for served rows) is shown beside them, not held to the target. With --paired a cell's
  value is the median of its rounds' ratios to the vLLM cell timed next to it; without (64 GiB),
  the ratio of the two medians (bench_report.reference_ratios). A cell is "over in every round"
  where each round's ratio is over 1.00: what noise does less often than a median just over.
- T = 4096: the same ratios at most 0.8.
- Time: the steps' seconds added up, each step's command exited 0; a machine's start is not in
  them (the run is to fit in 30 minutes with it).
- Anything not measured misses: a step, a run of an MPS mode, a held variant's cell of the grid
  (T 1, 16, 256, 4096 x lead 1, 4, 12 x pipelined, synced).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # bench_report needs common/
from bench_report import paired_ratios, reference_ratios  # noqa: E402
from common.timing import MODES  # noqa: E402

STEPS = ("tests", "uniform", "text", "64-off", "64-on")
# Each benchmark step's runs, by MPS mode (False: without, True: under).
RUNS = {"uniform": (False, True), "text": (False, True), "64-off": (False,), "64-on": (True,)}
TEST_LOGS = {"without MPS": "vllm_gpu.log", "under MPS": "mps/vllm_gpu.log"}
# The plugin variants the step targets hold, by MPS mode, and those shown beside them.
HELD = {"plugin_mapped": (False, True), "plugin_captured": (False, True)}
SHOWN = {**HELD, "plugin_served": (True,)}
GRID = {(tokens, lead, mode) for tokens in (1, 16, 256, 4096) for lead in (1, 4, 12)
        for mode in MODES}  # each held variant's cells, in each run
DECODE_MAX_TOKENS, DECODE_TARGET, PREFILL_TOKENS, PREFILL_TARGET = 256, 1.00, 4096, 0.8
TIME_TARGET_S = 30 * 60
# Words of pytest's summary line that mean a test did not run, or did not pass.
NOT_PASSED = ("failed", "error", "errors", "skipped", "deselected", "xfailed", "xpassed")


def member(step_dir: Path, name: str) -> bytes | None:
    """A file of the step's results.tgz (packed from its OUT as `./name`), or None."""
    packed = step_dir / "results.tgz"
    if not packed.is_file():
        return None
    with tarfile.open(packed) as tar:
        for candidate in (f"./{name}", name):
            try:
                file = tar.extractfile(candidate)
            except KeyError:
                continue
            if file is not None:
                return file.read()
    return None


def test_outcome(log: bytes | None) -> tuple[bool, str]:
    """(passed, what pytest's summary line says) of a GPU test log."""
    if log is None:
        return False, "no log"
    lines = [line for line in log.decode(errors="replace").splitlines()
             if re.match(r"^=+ .*\bin [\d.]+s", line)]
    if not lines:
        return False, "no summary line (stopped?)"
    summary = lines[-1].strip("= ")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}
    bad = sum(counts.get(word, 0) for word in NOT_PASSED)
    return counts.get("passed", 0) > 0 and bad == 0, summary


def step_cells(report: dict) -> dict[tuple, tuple[float, list[float]]]:
    """Per (mps, variant, tokens, lead, mode) of a shown plugin variant: (value, the rounds'
    ratios), paired where the run paired, else the ratio of medians (one value, no rounds)."""
    paired, _ = paired_ratios(report["steps"], "step_us")
    if paired:
        cells = {key: (statistics.median(rounds), rounds) for key, rounds in paired.items()}
    else:
        cells = {key: (value, []) for key, value in reference_ratios(report["steps"], "step_us").items()}
    return {key: value for key, value in cells.items() if key[0] in SHOWN.get(key[1], ())}


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def judge(folder: Path) -> tuple[list[str], bool]:
    """The markdown of every target's verdict, and whether all were met."""
    reports = {step: json.loads(data) for step in RUNS
               if (data := member(folder / step, "vllm_bench/bench_lookup.json")) is not None}
    sections = [rows_section(folder, reports), steps_section(reports), time_section(folder)]
    met = all(ok for _, ok in sections)
    lines = ["# vLLM with the plugin against vLLM alone: the whole run's targets", ""]
    for section, _ in sections:
        lines += [*section, ""]
    return [*lines, f"Every target: {verdict(met)}"], met


def rows_section(folder: Path, reports: dict) -> tuple[list[str], bool]:
    lines, met = ["## Rows", ""], True
    for label, log in TEST_LOGS.items():
        ok, summary = test_outcome(member(folder / "tests", log))
        lines.append(f"- GPU tests {label}: {summary}: {verdict(ok)}")
        met &= ok
    for step, modes in RUNS.items():
        if step not in reports:
            lines.append(f"- {step}: no bench_lookup.json: **missed**")
            met = False
            continue
        runs = {run["mps"]: run for run in reports[step]["runs"]}
        for mps in modes:
            mode = "under MPS" if mps else "without MPS"
            ok = mps in runs and runs[mps]["rows_exact"]
            what = "no run" if mps not in runs else "exact" if ok else "NOT exact"
            lines.append(f"- {step}, {mode}: rows {what}: {verdict(ok)}")
            met &= ok
    return lines, met


def steps_section(reports: dict) -> tuple[list[str], bool]:
    met = True
    decode = ["## Decode (T <= 256): the plugin's step / vLLM's, at most 1.00", "",
              "| step | MPS | variant | cells over 1.00 | over in every round | most | target |",
              "|---|---|---|---:|---:|---:|---|"]
    prefill = ["## T = 4096: the plugin's step / vLLM's, at most 0.8", "",
               "| step | MPS | variant | most | target |", "|---|---|---|---:|---|"]
    missing = []
    for step, report in reports.items():
        cells = step_cells(report)
        for mps in RUNS[step]:
            for variant in SHOWN:  # step_cells kept only the modes each is shown in
                held = mps in HELD.get(variant, ())
                mine = {key[2:]: value for key, value in cells.items() if key[:2] == (mps, variant)}
                lost = GRID - set(mine)
                if held and lost:
                    missing.append(f"- {step}, MPS {'on' if mps else 'off'}, {variant}: {len(lost)} "
                                   f"of {len(GRID)} cells not measured: **missed**")
                    met = False
                row = f"| {step} | {'on' if mps else 'off'} | {variant} |"
                short = [value for key, value in mine.items() if key[0] <= DECODE_MAX_TOKENS]
                if short:
                    over = [value for value, _ in short if value > DECODE_TARGET]
                    paired = all(rounds for _, rounds in short)  # else one value a cell, no rounds
                    every = sum(min(rounds) > DECODE_TARGET for _, rounds in short) if paired else "-"
                    decode.append(f"{row} {len(over)} of {len(short)} | {every} | "
                                  f"{max(v for v, _ in short):.3f} | {verdict(not over) if held else 'shown'} |")
                    met &= not (held and over)
                long = [value for key, (value, _) in mine.items() if key[0] == PREFILL_TOKENS]
                if long:
                    ok = max(long) <= PREFILL_TARGET
                    prefill.append(f"{row} {max(long):.3f} | {verdict(ok) if held else 'shown'} |")
                    met &= ok or not held
    return [*decode, "", *prefill, *(["", *missing] if missing else [])], met


def time_section(folder: Path) -> tuple[list[str], bool]:
    lines, met, seconds = ["## Time: the steps' commands, at most 30 minutes", ""], True, 0
    for step in STEPS:
        record = folder / step / "whole_run.json"
        if not record.is_file():
            lines.append(f"- {step}: not run (no whole_run.json): **missed**")
            met = False
            continue
        entry = json.loads(record.read_text())
        seconds += entry["seconds"]
        lines.append(f"- {step}: {entry['seconds']} s, exit {entry['exit']}"
                     + ("" if entry["exit"] == 0 else ": **missed**"))
        met &= entry["exit"] == 0
    lines.append(f"- in all: {seconds} s ({seconds / 60:.1f} min), not counting the machine's "
                 f"start: {verdict(seconds <= TIME_TARGET_S)}")
    return lines, met and seconds <= TIME_TARGET_S


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    lines, met = judge(args.dir)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
