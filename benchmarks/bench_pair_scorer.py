"""SAGE's segmentation head over adjacent sentence pairs: the native fused scorer against torch and numpy.

The head is sigmoid(w2 . relu(W1 [x1, x2, x1 - x2, x1 * x2] + b1) + b2) (SAGE, Wang et al. 2025, section 3.1).
Compared, on the same threads, the same random unit embeddings and the same weights:

- native: certrag._core.PairScorer (folded weights, packed panels; AVX-512, and AVX2 forced for comparison)
- native bfloat16: the opt-in path (AVX512_BF16, vdpbf16ps with float32 accumulation)
- torch unfused: concatenate the 4d features, Linear, ReLU, Linear, sigmoid (what a PyTorch user writes)
- torch folded: the same algebra as the native scorer in torch (three matmuls on [x_i, x_{i+1}, x_i * x_{i+1}])
- numpy unfused: the 4d features and two matmuls with numpy's BLAS

Reported: pairs/s (median of the repeats, methods interleaved in rotating order), and the fraction of the ceiling
that the machine's measured float32 matmul peak (torch, 4096^3, same threads) puts on the folded work of
6 * d * H flops per pair.

    python benchmarks/bench_pair_scorer.py            # 100k pairs, d = 384, H = 256, 2 threads
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    _common.pin_threads(args.threads)

    import numpy as np
    import torch

    import certrag
    from certrag.segment.head import SegmenterHead

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    d, H, n = args.dim, args.hidden, args.pairs + 1
    head = SegmenterHead(rng.normal(0, 0.05, (H, 4 * d)), rng.normal(0, 0.1, H), rng.normal(0, 0.1, H), 0.1)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    xt = torch.from_numpy(x)
    w1 = torch.from_numpy(head.w1)
    b1, w2 = torch.from_numpy(head.b1), torch.from_numpy(head.w2)
    wa, wb, wc, wd = w1[:, :d], w1[:, d:2 * d], w1[:, 2 * d:3 * d], w1[:, 3 * d:]
    w_left, w_right, w_prod = (wa + wc).T.contiguous(), (wb - wc).T.contiguous(), wd.T.contiguous()
    w1t = w1.T.contiguous()
    w1n, b1n, w2n = head.w1.T.copy(), head.b1, head.w2

    def torch_unfused():
        with torch.inference_mode():
            a, b = xt[:-1], xt[1:]
            h = torch.relu(torch.cat([a, b, a - b, a * b], dim=1) @ w1t + b1)
            return torch.sigmoid(h @ w2 + head.b2)

    def torch_folded():
        with torch.inference_mode():
            u, v = xt @ w_left, xt @ w_right
            h = torch.relu(u[:-1] + v[1:] + (xt[:-1] * xt[1:]) @ w_prod + b1)
            return torch.sigmoid(h @ w2 + head.b2)

    def numpy_unfused():
        a, b = x[:-1], x[1:]
        h = np.maximum(np.concatenate([a, b, a - b, a * b], axis=1) @ w1n + b1n, 0)
        return 1 / (1 + np.exp(-(h @ w2n + head.b2)))

    methods = {"native": lambda: head.score_adjacent(x, num_threads=args.threads)}
    if "avx2" in certrag.info()["simd_compiled"] and certrag.info()["simd_active"] == "avx512":
        methods["native (avx2 forced)"] = lambda: head.score_adjacent(x, num_threads=args.threads, level="avx2")
    if certrag.info()["bfloat16_pair_scorer"]:
        methods["native bfloat16"] = lambda: head.score_adjacent(x, num_threads=args.threads, precision="bfloat16")
    methods.update({"torch unfused": torch_unfused, "torch folded": torch_folded, "numpy unfused": numpy_unfused})

    reference = torch_unfused().numpy()
    max_err = {name: float(np.max(np.abs(np.asarray(fn()) - reference))) for name, fn in methods.items()}
    times = {name: [] for name in methods}
    names = list(methods)
    for rep in range(args.repeats + 1):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            t = time.perf_counter()
            methods[name]()
            if rep > 0:  # the first round warms up
                times[name].append(time.perf_counter() - t)

    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    a @ b
    peak = 2 * 4096**3 / _common.median_time(lambda: a @ b, 5) / 1e9
    ceiling = peak * 1e9 / (6 * d * H)
    unfused = args.pairs / float(np.median(times["torch unfused"]))
    rows = []
    for name in names:
        rate = args.pairs / float(np.median(times[name]))
        rows.append({"what": "pair_scorer", "method": name, "baseline": "torch unfused",
                     "params": {"pairs": args.pairs, "dim": d, "hidden": H, "threads": args.threads,
                                "repeats": args.repeats},
                     "pairs_per_s": rate, "ratio_to_torch_unfused": rate / unfused,
                     "fraction_of_ceiling": rate / ceiling, "max_abs_error_vs_torch_unfused": max_err[name],
                     **_common.percentiles_ms(times[name])})
    meta = _common.meta({"bench": "bench_pair_scorer", "matmul_peak_gflops": peak,
                         "ceiling_pairs_per_s": ceiling})
    native = rows[0]
    bf16 = next((r for r in rows if r["method"] == "native bfloat16"), None)
    bf16_line = (f"The opt-in bfloat16 path runs at {bf16['pairs_per_s']:,.0f} pairs/s, "
                 f"{bf16['ratio_to_torch_unfused']:.2f}x unfused torch (target >= 3x), with a largest probability "
                 f"error of {bf16['max_abs_error_vs_torch_unfused']:.1e} against it." if bf16 else
                 "This CPU lacks AVX512_BF16, so the bfloat16 path did not run.")
    text = "\n".join([
        "### Segmentation pair scorer (bench_pair_scorer.py)\n",
        f"**Verdict:** the native float32 scorer runs at {native['pairs_per_s']:,.0f} pairs/s, "
        f"{native['fraction_of_ceiling']:.0%} of the ceiling set by this machine's measured float32 matmul peak "
        f"({peak:.0f} GFLOP/s on {args.threads} threads -> {ceiling:,.0f} pairs/s for 6dH flops per pair) and "
        f"{native['ratio_to_torch_unfused']:.2f}x unfused torch (targets: >= 85% and >= 2x). {bf16_line}\n",
        f"{args.pairs:,} adjacent pairs of random unit vectors, d = {d}, H = {H}, {args.threads} threads; median of "
        f"{args.repeats} interleaved runs after a warm-up round. Error is the largest absolute difference in "
        f"probability from unfused torch.\n",
        _common.markdown_table(["method", "pairs/s", "x torch unfused", "of ceiling", "p50 ms", "max abs error"],
                               [[r["method"], r["pairs_per_s"], r["ratio_to_torch_unfused"],
                                 f"{r['fraction_of_ceiling']:.0%}", r["p50_ms"],
                                 f"{r['max_abs_error_vs_torch_unfused']:.1e}"] for r in rows]),
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_pair_scorer", rows, meta)
        _common.update_results_md("bench_pair_scorer", text)


if __name__ == "__main__":
    main()
