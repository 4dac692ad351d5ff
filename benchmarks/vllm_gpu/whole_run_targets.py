"""The whole run's targets (whole_run.sh), met or missed, from the files its steps brought back.

    python benchmarks/vllm_gpu/whole_run_targets.py DIR [--out FILE.md]

DIR holds a folder per step, named as the step (tests, uniform, text, 64-off, 64-on), each with
the results.tgz and whole_run.json that whole_run.sh wrote. A step that is not there is named
and counts as missed.

The targets, and what each is read from:
- Rows: the GPU tests passed without MPS and under it (`N passed`, nothing failed, errored or
  skipped: a skip there means no CUDA or no vLLM tree), and every benchmark run's rows exact
  (its row checks, the captured lookup's check() and no plugin build that raised).
- Decode, T <= 256: vLLM with engramd at most 1.00x vLLM alone: the plugin as a GPU replica
  gets it, mapped (plugin_mapped against vLLM's eager step, and plugin_captured, its step in a
  CUDA graph, against vLLM's graph), in both MPS modes. plugin_served under MPS (a client that
  asks for served rows) is shown beside them, not held to the target. With --paired a cell's
  value is the median of its rounds' ratios to the vLLM cell timed next to it; without (64 GiB),
  the ratio of the two medians (bench_report.reference_ratios). A cell is "over in every round"
  where each round's ratio is over 1.00: what noise does less often than a median just over.
- T = 4096: the same ratios at most 0.8.
- Time: the steps' seconds added up; a machine's start is not in them.
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

STEPS = ("tests", "uniform", "text", "64-off", "64-on")
BENCH_STEPS = STEPS[1:]
TEST_LOGS = {"without MPS": "vllm_gpu.log", "under MPS": "mps/vllm_gpu.log"}
# The plugin variants the step targets hold, by MPS mode (False: without, True: under), and those
# shown beside them.
HELD = {"plugin_mapped": (False, True), "plugin_captured": (False, True)}
SHOWN = {**HELD, "plugin_served": (True,)}
DECODE_MAX_TOKENS, DECODE_TARGET, PREFILL_TOKENS, PREFILL_TARGET = 256, 1.00, 4096, 0.8
TIME_TARGET_S = 30 * 60


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
    bad = sum(counts.get(word, 0) for word in ("failed", "error", "errors", "skipped"))
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


def judge(folder: Path) -> tuple[list[str], bool]:
    lines, met = ["# vLLM with the plugin against vLLM alone: the whole run's targets", ""], True

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    rows = ["## Rows", ""]
    for label, log in TEST_LOGS.items():
        ok, summary = test_outcome(member(folder / "tests", log))
        rows.append(f"- GPU tests {label}: {summary}: {verdict(ok)}")
        met &= ok
    reports: dict[str, dict] = {}
    for step in BENCH_STEPS:
        data = member(folder / step, "vllm_bench/bench_lookup.json")
        if data is None:
            rows.append(f"- {step}: no bench_lookup.json: **missed**")
            met = False
            continue
        reports[step] = json.loads(data)
        for run in reports[step]["runs"]:
            mode = "under MPS" if run["mps"] else "without MPS"
            rows.append(f"- {step}, {mode}: rows {'exact' if run['rows_exact'] else 'NOT exact'}: "
                        f"{verdict(run['rows_exact'])}")
            met &= run["rows_exact"]
    lines += [*rows, ""]

    decode = ["## Decode (T <= 256): the plugin's step / vLLM's, at most 1.00", "",
              "| step | MPS | variant | cells over 1.00 | over in every round | most | target |",
              "|---|---|---|---:|---:|---:|---|"]
    prefill = ["## T = 4096: the plugin's step / vLLM's, at most 0.8", "",
               "| step | MPS | variant | most | target |", "|---|---|---|---:|---|"]
    for step, report in reports.items():
        cells = step_cells(report)
        for mps, variant in sorted({(key[0], key[1]) for key in cells}):
            mine = {key: value for key, value in cells.items() if key[:2] == (mps, variant)}
            held = mps in HELD.get(variant, ())
            short = [v for key, v in mine.items() if key[2] <= DECODE_MAX_TOKENS]
            if short:
                over = [value for value, _ in short if value > DECODE_TARGET]
                paired = all(rounds for _, rounds in short)  # else one value a cell, no rounds
                every = sum(min(rounds) > DECODE_TARGET for _, rounds in short) if paired else "-"
                decode.append(f"| {step} | {'on' if mps else 'off'} | {variant} | {len(over)} of "
                              f"{len(short)} | {every} | {max(v for v, _ in short):.3f} | "
                              f"{verdict(not over) if held else 'shown'} |")
                met &= not (held and over)
            long = [value for key, (value, _) in mine.items() if key[2] == PREFILL_TOKENS]
            if long:
                ok = max(long) <= PREFILL_TARGET
                prefill.append(f"| {step} | {'on' if mps else 'off'} | {variant} | {max(long):.3f} | "
                               f"{verdict(ok) if held else 'shown'} |")
                met &= ok or not held
    lines += [*decode, "", *prefill, ""]

    seconds, timing = 0, ["## Time: the steps' commands, at most 30 minutes with the machine's start", ""]
    for step in STEPS:
        record = folder / step / "whole_run.json"
        if not record.is_file():
            timing.append(f"- {step}: not run (no whole_run.json): **missed**")
            met = False
            continue
        entry = json.loads(record.read_text())
        seconds += entry["seconds"]
        timing.append(f"- {step}: {entry['seconds']} s, exit {entry['exit']}")
        met &= entry["exit"] == 0
    timing.append(f"- in all: {seconds} s ({seconds / 60:.1f} min), before any machine's start: "
                  f"{verdict(seconds <= TIME_TARGET_S)}")
    met &= seconds <= TIME_TARGET_S
    lines += [*timing, "", f"Every target: {verdict(met)}"]
    return lines, met


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
