"""The pictures RESULTS.md shows, drawn from the recorded rows in benchmarks/results/*.json (no benchmark reruns):

- hnsw_recall_qps.png: recall@10 against batch queries per second over the ef sweep, certrag and each baseline
  (bench_index);
- retrieval_selection.png: gold recall against mean context tokens for top-k and every selector, each point
  labelled with its setting (bench_retrieval);
- retrieve_stages.png: where a query's time goes, per retrieval path (bench_encoders' speed part);
- factuality_roc.png: ROC curves of every factual-confidence score on held-out answers, the engine's own and the
  noise protocol's (bench_factuality).

    python benchmarks/plots.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def _rows(name: str) -> list[dict]:
    path = _common.RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def hnsw(plt) -> Path | None:
    rows = [r for r in _rows("bench_index") if r.get("what") == "hnsw_search"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for lib in sorted({r["library"] for r in rows}):
        pts = sorted((r for r in rows if r["library"] == lib), key=lambda r: r["recall_at_10"])
        ax.plot([r["recall_at_10"] for r in pts], [r["batch_qps"] for r in pts], "o-", label=lib, ms=4)
    ax.set_yscale("log")
    ax.set_xlabel("recall@10")
    ax.set_ylabel("batch queries / s (2 threads)")
    n = rows[0]["params"]
    ax.set_title(f"HNSW, {n['n']:,} x {n['dim']}-d, M={n['M']}: the ef sweep")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = _common.RESULTS_DIR / "hnsw_recall_qps.png"
    fig.savefig(out, dpi=110)
    return out


def selection(plt) -> Path | None:
    rows = [r for r in _rows("bench_retrieval") if r.get("what") == "selection"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"topk": "o-", "gradient": "s", "autocut": "^", "topp": "D"}
    for family, style in styles.items():
        pts = [r for r in rows if r["family"] == family]
        if not pts:
            continue
        ax.plot([r["context_tokens"] for r in pts], [r["gold_recall"] for r in pts], style, label=family, ms=4)
        for r in pts:
            label = re.sub(r"^top-(\d+)$", r"k\1", r["method"].replace("gradient ", "").replace("min_k=", "m"))
            ax.annotate(label, (r["context_tokens"], r["gold_recall"]), fontsize=6, xytext=(3, -7),
                        textcoords="offset points")
    ax.set_xlabel("mean context tokens sent")
    ax.set_ylabel("gold-passage recall of the selected set")
    ax.set_title("NQ-open test: what each selector keeps, at what cost")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = _common.RESULTS_DIR / "retrieval_selection.png"
    fig.savefig(out, dpi=120)
    return out


def stages(plt) -> Path | None:
    path = _common.RESULTS_DIR / "bench_encoders.json"
    if not path.exists():
        return None
    speed = json.loads(path.read_text())["rows"][0].get("speed", {})
    rows = [r for r in speed.get("retrieve", []) if "stage_mean_ms" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.55 * len(rows)))
    names = ["embed_ms", "search_ms", "rerank_ms", "select_ms"]
    left = [0.0] * len(rows)
    for name in names:
        vals = [r["stage_mean_ms"][name] for r in rows]
        ax.barh(range(len(rows)), vals, left=left, label=name.replace("_ms", ""))
        left = [a + b for a, b in zip(left, vals)]
    labels = [f"{r.get('store', 'NQ store')}\n{r['path']}" for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=6.5)
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per query")
    ax.set_title("retrieve(), mean time per stage")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = _common.RESULTS_DIR / "retrieve_stages.png"
    fig.savefig(out, dpi=110)
    return out


def roc(plt) -> Path | None:
    rows = [r for r in _rows("bench_factuality") if "heldout_engine_points" in r]
    if not rows:
        return None
    from sklearn.metrics import roc_curve

    fig, axes = plt.subplots(1, 2, figsize=(12, 6.4))
    for ax, kind, title in ((axes[0], "engine", "the engine's own answers"),
                            (axes[1], "protocol", "noise-protocol answers (3 passages)")):
        for r in rows:
            pts = r[f"heldout_{kind}_points"]
            if len(set(pts["label"])) < 2:
                continue
            fpr, tpr, _ = roc_curve(pts["label"], pts["score"])
            ax.plot(fpr, tpr, label=f"{r['score']} ({r[f'heldout_{kind}']:.3f})", lw=1.4)
        ax.plot([0, 1], [0, 1], ":", color="grey", lw=1)
        ax.set_xlabel("false positive rate (unsupported answers trusted)")
        ax.set_ylabel("true positive rate")
        ax.set_title(f"held-out test: {title}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(0, -0.14), title="score (AUROC)", title_fontsize=7)
    fig.tight_layout()
    out = _common.RESULTS_DIR / "factuality_roc.png"
    fig.savefig(out, dpi=110)
    return out


def draw(*drawers) -> None:
    """Draw the given pictures (default: every one) from the recorded rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for drawer in drawers or (hnsw, selection, stages, roc):
        out = drawer(plt)
        plt.close("all")
        print(f"{drawer.__name__}: {out.relative_to(_common.ROOT) if out else 'no rows yet'}")


def main() -> None:
    draw()


if __name__ == "__main__":
    main()
