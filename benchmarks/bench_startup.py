"""Start-up: what a newcomer waits for before the first result (issue 34 item 6).

Each command runs in a fresh process, rounds interleaved, medians reported: `certrag info STORE`, a cold `certrag
search STORE QUESTION` (imports, store, both encoders loaded, one query), and `python -c "import torch"` -- the floor
any torch encoder pays -- beside them; with --baseline-src, the same commands run from another checkout's source
tree (an older commit: `git worktree add /tmp/old <commit>`, with the built _core copied in) in the same rounds.

    python benchmarks/bench_startup.py --store ~/.cache/certrag/demo-store-400-1500 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

QUESTION = "who wrote the declaration of independence"


def timed(cmd: list[str], src: str | None) -> float:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    t = time.perf_counter()
    # from a neutral folder: `python -m` puts the working directory first on sys.path, so run from the repository
    # every command would import this checkout's certrag whatever PYTHONPATH says
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    dt = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-500:]}")
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, type=Path)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--baseline-src", default=None, help="another checkout's source tree, run in the same rounds")
    p.add_argument("--baseline-name", default="baseline")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if not (args.store / "CURRENT").exists() and not (args.store / "manifest.json").exists():
        p.error(f"--store: {args.store} is not a certrag store")
    py = sys.executable
    commands = {"certrag info": [py, "-m", "certrag.cli", "info", str(args.store)],
                "cold certrag search": [py, "-m", "certrag.cli", "search", str(args.store), QUESTION],
                'python -c "import torch"': [py, "-c", "import torch"]}
    runs = [(name, cmd, None, "this commit") for name, cmd in commands.items()]
    if args.baseline_src:
        runs += [(name, cmd, args.baseline_src, args.baseline_name) for name, cmd in commands.items()
                 if name != 'python -c "import torch"']
    for name, cmd, src, _ in runs:  # warm the file cache once
        timed(cmd, src)
    times: dict = {}
    for _ in range(args.rounds):
        for name, cmd, src, who in runs:
            times.setdefault((name, who), []).append(timed(cmd, src))
    rows = [{"what": "startup", "command": name, "code": who, "median_s": statistics.median(v), "min_s": min(v),
             "max_s": max(v), "rounds": len(v)} for (name, who), v in times.items()]
    meta = _common.meta({"bench": "bench_startup", "store": str(args.store), "rounds": args.rounds,
                         "baseline": args.baseline_name if args.baseline_src else None})
    text = "\n".join([
        "### Start-up (bench_startup.py)\n",
        f"Fresh processes, {args.rounds} interleaved rounds after one warm-up each; the store "
        f"`{args.store.name}`.\n",
        _common.markdown_table(["command", "code", "median s", "min s", "max s"],
                               [[r["command"], r["code"], r["median_s"], r["min_s"], r["max_s"]] for r in rows]),
        "", _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_startup", rows, meta)
        _common.update_results_md("bench_startup", text)


if __name__ == "__main__":
    main()
