"""The reliability probes at release length: the stress, fuzz and property tests of tests/test_reliability.py and
tests/test_engine_model.py with CERTRAG_LONG_TESTS=1 (10x the reliability review's probes where it counted them),
their counts and outcomes written to RESULTS.md.

    python benchmarks/bench_reliability.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

REVIEW = {
    "finding 1": "review: 219 KeyError, 72 IndexError and 2 wrong pairings among concurrent retrievals",
    "finding 2": "review: 63 bad rows of ~218k over 6 runs (3 searchers, 1 adder)",
    "finding 3": "review: 479 of 12,536 manifest bit flips opened silently",
    "finding 4": "review: 6 of 3,124 read-only opens failed with FileNotFoundError",
    "index loader fuzz": "review: 142 hostile index inputs, no crash",
    "store loader fuzz": "review: forked opens of corrupted stores, no crash",
    "engine state machine": "new: add / remove / retrieve / reopen against a brute-force model",
}


def main() -> None:
    started = time.perf_counter()
    env = dict(os.environ, CERTRAG_LONG_TESTS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_reliability.py",
           "tests/test_engine_model.py"]
    run = subprocess.run(cmd, cwd=_common.ROOT, env=env, capture_output=True, text=True)
    out = run.stdout + run.stderr
    probes = [line.strip() for line in out.splitlines()
              if re.match(r"\s*(finding \d|index loader fuzz|store loader fuzz|engine state machine)", line)]
    summary = next((line.strip() for line in reversed(out.splitlines()) if " passed" in line or " failed" in line),
                   "no summary")
    rows = [{"probe": p, "review": next((v for k, v in REVIEW.items() if p.startswith(k)), "")} for p in probes]
    meta = _common.meta({"pytest": summary, "seconds": round(time.perf_counter() - started)})
    _common.write_rows("bench_reliability", rows, meta)
    table = _common.markdown_table(["probe at release length (this run)", "the review"],
                                   [[r["probe"], r["review"]] for r in rows])
    md = ("## Reliability at release length (bench_reliability.py)\n\n"
          f"`CERTRAG_LONG_TESTS=1` runs of tests/test_reliability.py and tests/test_engine_model.py: **{summary}** "
          f"in {meta['seconds']} s. Every wrong result or unexpected exception would fail its test; the counts are "
          "the probes each test made.\n\n" + table + "\n" + _common.footer(meta))
    _common.update_results_md("bench_reliability", md)
    print(md)
    if run.returncode != 0:
        print(out[-4000:], file=sys.stderr)
        raise SystemExit(run.returncode)


if __name__ == "__main__":
    main()
