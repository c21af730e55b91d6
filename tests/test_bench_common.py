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
