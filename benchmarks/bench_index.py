"""Native HNSW index against hnswlib, faiss (IndexHNSWFlat), usearch and exact numpy search.

Reproduces the kind of comparison in Malkov & Yashunin (2018), Fig. 10-11 and ann-benchmarks: recall@10 against
throughput over a sweep of the search breadth ef, at equal M and ef_construction, plus build time and single-query
latency. Each library runs in its own subprocess, pinned to the same CPUs, on the same vectors and queries:

- certrag.HnswIndex (this build: no -march=native, run-time SIMD dispatch)
- hnswlib as pip builds it (from source with -march=native: what users get) and built with HNSWLIB_NO_NATIVE=1
- faiss-cpu IndexHNSWFlat with SearchParametersHNSW(efSearch) per call
- usearch Index (expansion_search set per sweep point)
- numpy exact search (matmul + argpartition): the recall oracle and the brute-force baseline

Data: clustered, normalised, low-intrinsic-dimension vectors shaped like sentence embeddings (certrag.data.vectors);
uniform random vectors make every HNSW look broken (recall ~0.42 even at ef=512).

    python benchmarks/bench_index.py                  # 100k x 384, 1000 queries, 2 threads
    python benchmarks/bench_index.py --n 20000 --libs certrag,hnswlib   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

LIBS = ["certrag", "hnswlib", "hnswlib-nonative", "faiss", "usearch", "numpy"]
NONNATIVE_DIR = _common.DATA_DIR / "hnswlib_nonative"


def ensure_nonnative_hnswlib() -> Path:
    """Builds hnswlib from source with HNSWLIB_NO_NATIVE=1 into a private folder, once."""
    if not any(NONNATIVE_DIR.glob("hnswlib*.so")):
        version = __import__("importlib.metadata").metadata.version("hnswlib")
        env = dict(os.environ, HNSWLIB_NO_NATIVE="1")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-binary", "hnswlib", "--no-deps",
                        "--no-cache-dir", "--target", str(NONNATIVE_DIR), f"hnswlib=={version}"], env=env, check=True)
    return NONNATIVE_DIR


# ----------------------------------------------------------------------------------------------------------- worker

class Adapter:
    def __init__(self, lib, dim, M, efc, threads):
        self.lib, self.dim, self.M, self.efc, self.threads = lib, dim, M, efc, threads

    def build(self, base):
        import numpy as np

        lib = self.lib
        if lib == "certrag":
            import certrag

            self.index = certrag.HnswIndex(self.dim, "ip", self.M, self.efc)
            self.index.add(base, num_threads=self.threads)
        elif lib.startswith("hnswlib"):
            import hnswlib

            self.index = hnswlib.Index(space="ip", dim=self.dim)
            self.index.init_index(max_elements=len(base), M=self.M, ef_construction=self.efc, random_seed=0)
            self.index.set_num_threads(self.threads)
            self.index.add_items(base, np.arange(len(base)))
        elif lib == "faiss":
            import faiss

            faiss.omp_set_num_threads(self.threads)
            self.index = faiss.IndexHNSWFlat(self.dim, self.M, faiss.METRIC_INNER_PRODUCT)
            self.index.hnsw.efConstruction = self.efc
            self.index.add(base)
        elif lib == "usearch":
            from usearch.index import Index

            self.index = Index(ndim=self.dim, metric="ip", dtype="f32", connectivity=self.M,
                               expansion_add=self.efc, expansion_search=64)
            self.index.add(np.arange(len(base)), base, threads=self.threads)
        elif lib == "numpy":
            self.base = base
        else:
            raise ValueError(f"unknown library {lib}")

    def search(self, queries, k, ef, threads):
        """Returns int64 ids (n, k)."""
        import numpy as np

        lib = self.lib
        if lib == "certrag":
            return self.index.search(queries, k, ef=ef, num_threads=threads).ids
        if lib.startswith("hnswlib"):
            self.index.set_ef(ef)
            return self.index.knn_query(queries, k=k, num_threads=threads)[0]
        if lib == "faiss":
            import faiss

            faiss.omp_set_num_threads(threads)
            return self.index.search(queries, k, params=faiss.SearchParametersHNSW(efSearch=ef))[1]
        if lib == "usearch":
            self.index.expansion_search = ef
            return self.index.search(queries, k, threads=threads).keys
        # BLAS threads are capped by the environment that pin_threads() set before numpy was imported.
        scores = np.atleast_2d(queries) @ self.base.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1)
        return np.take_along_axis(part, order, axis=1)


def run_worker(args) -> None:
    """Builds each library's index in turn (timed alone), then measures them interleaved.

    Interleaving (each repeat and each single query visits the libraries in a rotating order) puts machine noise on
    all of them alike, so the ratios between libraries are steadier than the absolute numbers.
    """
    _common.pin_threads(args.threads)
    libs = args.worker.split(",")
    if "hnswlib-nonative" in libs:
        if "hnswlib" in libs:
            raise SystemExit("hnswlib and hnswlib-nonative share a module name: give them separate workers")
        sys.path.insert(0, str(NONNATIVE_DIR))
    import numpy as np

    from certrag.data.vectors import recall_at_k

    data = np.load(args.data)
    base, queries, truth = data["base"], data["queries"], data["truth"]
    k = truth.shape[1]
    adapters, build_s = {}, {}
    for lib in libs:
        adapters[lib] = Adapter(lib, base.shape[1], args.M, args.efc, args.threads)
        t = time.perf_counter()
        adapters[lib].build(base)
        build_s[lib] = time.perf_counter() - t
    single = queries[: args.single_queries]
    rows = []
    for i, ef in enumerate(args.efs):
        active = [lib for lib in libs if lib != "numpy" or i == 0]
        recall, batch, lat = {}, {lib: [] for lib in active}, {lib: [] for lib in active}
        for lib in active:
            recall[lib] = recall_at_k(np.asarray(adapters[lib].search(queries, k, ef, args.threads)), truth)
            for q in single[:50]:
                adapters[lib].search(q[None, :], k, ef, 1)
        for rep in range(args.repeats):
            for lib in active[rep % len(active):] + active[: rep % len(active)]:
                t = time.perf_counter()
                adapters[lib].search(queries, k, ef, args.threads)
                batch[lib].append(time.perf_counter() - t)
        for j, q in enumerate(single):
            q2 = q[None, :]
            for lib in active[j % len(active):] + active[: j % len(active)]:
                t = time.perf_counter()
                adapters[lib].search(q2, k, ef, 1)
                lat[lib].append(time.perf_counter() - t)
        for lib in active:
            rows.append({"what": "hnsw_search", "library": lib, "baseline": "hnswlib",
                         "params": {"n": len(base), "dim": base.shape[1], "M": args.M, "ef_construction": args.efc,
                                    "ef": None if lib == "numpy" else ef, "k": k, "threads": args.threads,
                                    "queries": len(queries), "interleaved_with": active},
                         "build_s": build_s[lib], "recall_at_10": recall[lib],
                         "batch_qps": len(queries) / float(np.median(batch[lib])), **_common.percentiles_ms(lat[lib])})
    print(json.dumps(rows))


# ------------------------------------------------------------------------------------------------------------- main

def prepare_data(n, dim, n_queries, k, seed) -> Path:
    import numpy as np

    from certrag.data.vectors import clustered_vectors, exact_search

    path = _common.DATA_DIR / f"index_{n}_{dim}_{n_queries}_{seed}.npz"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        base, queries = clustered_vectors(n, dim, n_queries=n_queries, seed=seed)
        truth, _ = exact_search(base, queries, k)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, base=base, queries=queries, truth=truth)
        tmp.replace(path)
    return path


def summarise(rows, args) -> str:
    by_lib: dict[str, list[dict]] = {}
    for r in rows:
        if r["group"] == 0:
            by_lib.setdefault(r["library"], []).append(r)
    m = rows[0]["params"]
    lines = ["### HNSW index (bench_index.py)\n",
             f"{m['n']:,} clustered unit vectors of dimension {m['dim']} (certrag.data.vectors), {m['queries']} queries, "
             f"recall@10 against exact search, M={m['M']}, ef_construction={m['ef_construction']}, "
             f"{m['threads']} threads for build and batch search, 1 thread per single query; batch time is the "
             f"median of {args.repeats} runs after a warm-up; single-query latency over {args.single_queries} "
             f"queries. All libraries ran in one process, interleaved (rotating order per repeat and per query) so "
             f"that machine noise and cache pressure fall on all alike. hnswlib-nonative shares hnswlib's module "
             f"name, so it ran in a second process beside a second certrag build; its table is separate.\n",
             "![recall@10 against batch QPS over the ef sweep](results/hnsw_recall_qps.png)\n"]
    lines.append("Build time:\n")
    lines.append(_common.markdown_table(
        ["library", "build s", "ratio to hnswlib"],
        [[lib, rs[0]["build_s"], rs[0]["build_s"] / by_lib["hnswlib"][0]["build_s"] if "hnswlib" in by_lib else ""]
         for lib, rs in by_lib.items()]))
    lines.append("\nSweep over ef (recall@10 / batch QPS / single-query p50 ms / p99 ms):\n")
    table = []
    for lib, rs in by_lib.items():
        for r in rs:
            table.append([lib, r["params"]["ef"] or "exact", r["recall_at_10"], r["batch_qps"], r["p50_ms"],
                          r["p99_ms"]])
    lines.append(_common.markdown_table(["library", "ef", "recall@10", "batch QPS", "p50 ms", "p99 ms"], table))

    target = 0.95
    lines.append(f"\nOperating point: the smallest ef that reaches recall@10 >= {target} for each library, and "
                 f"certrag's ratio against it (QPS ratio = certrag / other; p50 ratio = other / certrag; >= 1.0 "
                 f"means certrag is no worse):\n")
    ops = {}
    for lib, rs in by_lib.items():
        ok = [r for r in rs if r["recall_at_10"] >= target]
        if ok:
            ops[lib] = min(ok, key=lambda r: r["params"]["ef"] or 0)
    op_rows = []
    mine = ops.get("certrag")
    for lib, r in ops.items():
        op_rows.append([lib, r["params"]["ef"] or "exact", r["recall_at_10"], r["batch_qps"], r["p50_ms"],
                        (mine["batch_qps"] / r["batch_qps"]) if mine else "",
                        (r["p50_ms"] / mine["p50_ms"]) if mine else ""])
    lines.append(_common.markdown_table(
        ["library", "ef", "recall@10", "batch QPS", "p50 ms", "certrag QPS ratio", "certrag p50 ratio"], op_rows))
    if mine and "hnswlib" in ops:
        h = ops["hnswlib"]
        qps, p50 = mine["batch_qps"] / h["batch_qps"], h["p50_ms"] / mine["p50_ms"]
        build = mine["build_s"] / h["build_s"]
        ok = qps >= 1.0 and p50 >= 1.0 and build <= 1.2
        lines.insert(1, f"**Verdict:** at recall@10 >= {target}, certrag's batch QPS is {qps:.2f}x and its "
                        f"single-query p50 {p50:.2f}x hnswlib's (>= 1.0 is no worse), and it builds in {build:.2f}x "
                        f"hnswlib's time (target <= 1.2): target {'met' if ok else 'NOT met'} in this run.\n")
    if mine and "hnswlib" in by_lib:
        same_ef = {r["params"]["ef"]: r for r in by_lib["hnswlib"]}
        eq = [[r["params"]["ef"], r["recall_at_10"], same_ef[r["params"]["ef"]]["recall_at_10"],
               r["batch_qps"] / same_ef[r["params"]["ef"]]["batch_qps"],
               same_ef[r["params"]["ef"]]["p50_ms"] / r["p50_ms"]]
              for r in by_lib["certrag"] if r["params"]["ef"] in same_ef]
        lines.append("\ncertrag against hnswlib (native build) at equal ef:\n")
        lines.append(_common.markdown_table(
            ["ef", "certrag recall", "hnswlib recall", "QPS ratio", "p50 ratio"], eq))
    second = [r for r in rows if r["group"] == 1]
    if second:
        mine2 = {r["params"]["ef"]: r for r in second if r["library"] == "certrag"}
        other = [r for r in second if r["library"] == "hnswlib-nonative"]
        lines.append("\ncertrag against hnswlib built with HNSWLIB_NO_NATIVE=1 (second process, interleaved):\n")
        lines.append(_common.markdown_table(
            ["ef", "certrag recall", "nonnative recall", "certrag QPS", "nonnative QPS", "QPS ratio", "p50 ratio",
             "build ratio"],
            [[r["params"]["ef"], mine2[r["params"]["ef"]]["recall_at_10"], r["recall_at_10"],
              mine2[r["params"]["ef"]]["batch_qps"], r["batch_qps"],
              mine2[r["params"]["ef"]]["batch_qps"] / r["batch_qps"], r["p50_ms"] / mine2[r["params"]["ef"]]["p50_ms"],
              mine2[r["params"]["ef"]]["build_s"] / r["build_s"]] for r in other]))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--single-queries", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--M", type=int, default=16)
    p.add_argument("--efc", type=int, default=200)
    p.add_argument("--efs", type=lambda s: [int(x) for x in s.split(",")], default=[16, 24, 32, 48, 64, 96, 128, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print the table without touching results files")
    p.add_argument("--render", action="store_true",
                   help="rebuild the RESULTS.md section from benchmarks/results/bench_index.json without running")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return

    if args.render:
        saved = json.loads((_common.RESULTS_DIR / "bench_index.json").read_text())
        meta = saved["meta"]
        text = summarise(saved["rows"], argparse.Namespace(**meta["args"]))
        text += "\n" + _common.footer(meta)
        _common.update_results_md("bench_index", text)
        print(text)
        return

    libs = args.libs.split(",")
    unknown = set(libs) - set(LIBS)
    if unknown:
        p.error(f"--libs: unknown {sorted(unknown)}; choose from {LIBS}")
    if "hnswlib-nonative" in libs:
        ensure_nonnative_hnswlib()
    data = prepare_data(args.n, args.dim, args.queries, 10, args.seed)
    # Everything that can share a process is measured interleaved in one worker; hnswlib-nonative needs its own,
    # where certrag runs again beside it so that its ratio also comes from one interleaved run.
    groups = [[lib for lib in libs if lib != "hnswlib-nonative"]]
    if "hnswlib-nonative" in libs:
        groups.append(["certrag", "hnswlib-nonative"])
    rows = []
    for group_no, group in enumerate(g for g in groups if g):
        lib = ",".join(group)
        cmd = [sys.executable, __file__, "--worker", lib, "--data", str(data), "--threads", str(args.threads),
               "--M", str(args.M), "--efc", str(args.efc), "--efs", ",".join(map(str, args.efs)),
               "--repeats", str(args.repeats), "--single-queries", str(args.single_queries)]
        print(f"[bench_index] {lib} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{lib} worker failed:\n{out.stderr[-3000:]}")
        lib_rows = json.loads(out.stdout.strip().splitlines()[-1])
        for r in lib_rows:
            r["group"] = group_no
            print(f"  ef={r['params']['ef']} recall={r['recall_at_10']:.4f} qps={r['batch_qps']:.0f} "
                  f"p50={r['p50_ms']:.3f}ms build={r['build_s']:.1f}s", file=sys.stderr)
        rows += lib_rows
    meta = _common.meta({"bench": "bench_index", "args": {"repeats": args.repeats,
                                                          "single_queries": args.single_queries}})
    text = summarise(rows, args)
    text += "\n" + _common.footer(meta)
    print(text)
    if not args.no_write:
        for r in rows:
            r.update(machine=meta["machine"], commit=meta["commit"])
        _common.write_rows("bench_index", rows, meta)
        _common.update_results_md("bench_index", text)


if __name__ == "__main__":
    main()
