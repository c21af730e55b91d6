"""Shared plumbing for the benchmark scripts: machine and commit identity, thread pinning, timing, result files.

Every script writes rows of one schema to benchmarks/results/<name>.json and replaces its own section of
benchmarks/RESULTS.md (between ``<!-- name:start -->`` and ``<!-- name:end -->``), so reruns never duplicate tables.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
DATA_DIR = BENCH_DIR / "data"  # git-ignored scratch: generated data, baseline builds


def pin_threads(threads: int, offset: int = 0) -> None:
    """Pins this process to `threads` CPUs starting at the offset-th allowed one (wrapping around), and caps every
    thread pool we know of, before they start. Worker processes pass their index as the offset, so that they run
    on different cores rather than all on the first."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        # the CPUs the first benchmark process was allowed, which its workers inherit through the environment: a
        # worker started by a parent that pinned itself would otherwise see only the parent's one core
        known = os.environ.get("CERTRAG_BENCH_CPUS")
        allowed = [int(c) for c in known.split(",")] if known else sorted(os.sched_getaffinity(0))
        os.environ["CERTRAG_BENCH_CPUS"] = ",".join(map(str, allowed))
        cpus = [allowed[(offset * threads + i) % len(allowed)] for i in range(min(threads, len(allowed)))]
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):
        pass


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    # quoted as a shell needs (an empty argument stays visible: --ratios '')
    return " ".join([Path(sys.executable).name, *map(shlex.quote, sys.argv)])


def percentiles_ms(seconds: list[float] | np.ndarray) -> dict:
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99))}


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def write_rows(name: str, rows: list[dict], meta: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    tmp.replace(path)
    return path


def meta(extra: dict | None = None) -> dict:
    return {"machine": machine(), "commit": commit(), "command": command_line(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **(extra or {})}


def shard_path(stem: str, shard: int, workers: int, reverse: bool = False) -> Path:
    """The rows file of one worker of a sharded benchmark run (reverse: a helper taking the shard from its end)."""
    return DATA_DIR / f"{stem}-shard{shard}of{workers}{'-rev' if reverse else ''}.jsonl"


def shard_rows(stem: str, workers: int) -> list[dict]:
    """Every row a sharded run has written so far: its workers' files and their helpers' (whole rows only: a worker
    may be writing one)."""
    rows = []
    for path in shard_paths(stem, workers):
        if path.exists():
            text = path.read_text()
            rows += [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    return rows


def shard_paths(stem: str, workers: int) -> list[Path]:
    """The rows files a sharded run may have: each worker's and its helper's."""
    return [shard_path(stem, i, workers, rev) for i in range(workers) for rev in (False, True)]


def shards_archive(stem: str) -> Path:
    """The committed copy of a sharded run's rows (benchmarks/data is scratch)."""
    return RESULTS_DIR / f"{stem}.rows.jsonl.gz"


def archive_shards(stem: str, workers: int) -> None:
    archive_rows(shard_paths(stem, workers), shards_archive(stem))


def seed_shards(stem: str, workers: int) -> None:
    """A sharded run with no rows here (a fresh clone or machine) starts from its committed archive: the archived
    rows become the first worker's file (a resumed run skips every row in any of its files)."""
    if not any(p.exists() for p in shard_paths(stem, workers)):
        seed_rows(shard_path(stem, 0, workers), shards_archive(stem))


def archive_rows(sources: list[Path], archive: Path) -> None:
    """Keeps the rows of a long run's files (benchmarks/data is scratch) in a committed, gzipped copy: whole rows only
    (a worker may be writing one), written atomically; mtime 0, so the same rows give the same bytes and an unchanged
    archive shows no diff."""
    import gzip

    data = b""
    for path in sources:
        if path.exists():
            chunk = path.read_bytes()
            data += chunk[:chunk.rfind(b"\n") + 1]
    tmp = archive.with_suffix(f".{os.getpid()}.tmp")  # each process its own, so two never mix their bytes
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(data)
    tmp.replace(archive)


def seed_rows(path: Path, archive: Path) -> int | None:
    """Starts the rows file `path` from its committed archive when the file is absent (a fresh clone or machine), so
    a run continues where the archive left it; returns the rows seeded, or None when nothing was seeded. Made by a
    hard link, create-if-absent: a process that seeded (and may be appending) first is kept."""
    import gzip

    if path.exists() or not archive.exists():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with gzip.open(archive, "rt") as src:
        tmp.write_text(src.read())
    try:
        os.link(tmp, path)
        seeded = sum(1 for _ in path.open())
        print(f"continuing from {archive.name} ({seeded} rows)", file=sys.stderr)
        return seeded
    except FileExistsError:
        return None
    finally:
        tmp.unlink()


def update_results_md(name: str, markdown: str) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmark results\n"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = RESULTS_MD.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(RESULTS_MD)


def kernels(engine) -> dict:
    """What decides a row's numbers besides the code: the native SIMD level and q8 kernel (capped by CERTRAG_SIMD),
    torch's CPU capability (capped by ATEN_CPU_CAPABILITY) and the embedder's and reranker's backend. Greedy tokens can
    differ between AVX2 and AVX-512 kernels, so every generating benchmark records them with each row and its report
    says when a run's rows were made with more than one set (kernel_provenance)."""
    import torch

    from certrag import _core

    info = _core.build_info()
    return {"simd": info["simd_active"], "q8": info["q8_kernel"], "torch": torch.backends.cpu.get_cpu_capability(),
            "encoders": f"{engine.embedder.backend.backend}/{engine.reranker.backend.backend}"}


def kernel_provenance(rows: list[dict]) -> str:
    """A sentence counting the questions by the kernels their rows were made with; empty when a run used one set.
    rows: records with the question index "q" and, where recorded, "kernels"."""
    made_with: dict = {}
    for r in rows:
        k = r.get("kernels")
        made_with.setdefault(", ".join(f"{a} {b}" for a, b in k.items()) if k else "not recorded", set()).add(r["q"])
    if len(made_with) < 2:
        return ""
    return " Questions by the kernels their rows were made with: " + "; ".join(
        f"{k}: {len(v)}" for k, v in sorted(made_with.items())) + "."


def footer(meta: dict) -> str:
    """The provenance lines closing every RESULTS.md section."""
    return (f"\nMachine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; commit {meta['commit']}; "
            f"{meta['date']}.\nCommand: `{meta['command']}`\n")


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def concurrent_latency(call, questions: list[str], callers: int) -> dict:
    """Runs call(question) for every question from `callers` threads sharing one queue; returns the per-call
    latency percentiles (ms), the count and the throughput (calls/s over the wall time)."""
    import threading

    times, lock, work = [], threading.Lock(), list(questions)

    def caller():
        while True:
            with lock:
                if not work:
                    return
                q = work.pop()
            t = time.perf_counter()
            call(q)
            with lock:
                times.append(time.perf_counter() - t)

    started = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {"callers": callers, "queries": len(times), "throughput_qps": len(times) / wall, **percentiles_ms(times)}



def bootstrap(values, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the mean of values (paired differences: pass the per-question differences)."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), (reps, len(v)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))
