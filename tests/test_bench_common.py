"""The benchmarks' shared helpers that decide what a measurement means (benchmarks/_common.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to place workers on")
@pytest.mark.slow  # starts a subprocess
def test_workers_of_a_pinned_parent_land_on_different_cores():
    """A parent pins itself to one core, then starts workers that pin themselves by their index: worker 1 must get
    the parent's second allowed CPU, not the parent's only one (they all shared core 0 before)."""
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys, _common\n"
            "_common.pin_threads(1)\n"
            "child = 'import os, _common; _common.pin_threads(1, offset=1); print(sorted(os.sched_getaffinity(0)))'\n"
            "print(sorted(os.sched_getaffinity(0)))\n"
            "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True, check=True).stdout)")
    env = {k: v for k, v in os.environ.items() if k != "CERTRAG_BENCH_CPUS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=BENCH, env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == str([allowed[0]])
    assert out[1] == str([allowed[1]])


def test_kernel_provenance_counts_questions_by_the_kernels_their_rows_were_made_with(monkeypatch):
    """A run resumed on another CPU mixes rows made with different kernels (greedy tokens can differ between them):
    the report counts distinct questions per kernel set, and says nothing when every row shares one."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common
    avx2 = {"simd": "avx2", "q8": "avx2"}
    avx512 = {"simd": "avx512", "q8": "avx512-vnni"}
    one_set = [{"q": q, "kernels": avx512} for q in (0, 0, 1)]
    assert _common.kernel_provenance(one_set) == ""
    mixed = one_set + [{"q": 2, "kernels": avx2}, {"q": 2, "kernels": avx2}, {"q": 3}]
    text = _common.kernel_provenance(mixed)
    assert "simd avx512, q8 avx512-vnni: 2" in text
    assert "simd avx2, q8 avx2: 1" in text
    assert "not recorded: 1" in text
