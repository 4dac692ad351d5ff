"""tests/gpu/conftest.py: a test under tests/gpu that says nothing of CUDA still carries the
`gpu` marker and skips without CUDA; a test elsewhere gets neither."""

from __future__ import annotations

from pathlib import Path

import torch

pytest_plugins = ["pytester"]

GPU_CONFTEST = Path(__file__).parent / "gpu" / "conftest.py"
BARE = "def test_bare():\n    assert True\n"


def _suite(pytester):
    gpu = pytester.mkpydir("gpu")
    (gpu / "conftest.py").write_text(GPU_CONFTEST.read_text())
    (gpu / "test_gpu_bare.py").write_text(BARE)
    deeper = pytester.mkpydir("gpu/deeper")
    (deeper / "test_deeper_bare.py").write_text(BARE)
    pytester.makepyfile(test_cpu_bare=BARE)


def test_gpu_folder_tests_carry_the_marker(pytester):
    _suite(pytester)
    result = pytester.runpytest("-p", "no:cacheprovider", "-m", "not gpu")
    result.assert_outcomes(passed=1, deselected=2)
    result.stdout.fnmatch_lines(["*test_cpu_bare.py*"])


def test_gpu_folder_tests_skip_without_cuda(pytester):
    _suite(pytester)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    if torch.cuda.is_available():
        result.assert_outcomes(passed=3)
    else:
        result.assert_outcomes(passed=1, skipped=2)
        result.stdout.fnmatch_lines(["*SKIPPED*needs CUDA*"])


def test_every_test_of_the_suite_under_tests_gpu_is_marked(pytester):
    """The real folder, collected: `-m "not gpu"` leaves none of its tests."""
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider",
                                           "-m", "not gpu", str(GPU_CONFTEST.parent))
    assert "error" not in result.stdout.str().lower(), result.stdout.str()
    assert result.ret == 5, result.stdout.str()  # no tests collected: every one deselected
    result.stdout.fnmatch_lines(["*no tests collected (* deselected)*"])
