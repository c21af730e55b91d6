"""Adaptive reranking: when is the dense ranking already decisive?

The rule is one threshold on the dense lead of the first candidate over the second (gap = cos_1 - cos_2): a
question whose gap reaches it keeps the dense order and skips the cross-encoder. It is fitted on NQ-open's train
split only: for each train question, the reciprocal rank of its gold passage under the dense order and under the
reranked order (20 candidates, exact dense search over the train gold passages plus the Wikipedia leads, as the
reranker was mined); skipping the questions with the largest gaps first, the threshold is the lowest gap at which
the mean reciprocal rank lost over all train questions stays within `budget` (default 0.001, half the 0.002 that
issue 16 allows on test, for the difference between splits). The reranker was trained on these questions, so its
train ranking is better than its test one: the loss counted here is an over-estimate, and the rule errs on the side
of reranking.

    python -m certrag.train.skip_rule            # fits and writes the rule into the default reranker's card
    python -m certrag.train.skip_rule --reranker certrag/reranker    # the 6-layer one's
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def reciprocal_rank(scores: np.ndarray, gold: int, depth: int = 10) -> float:
    """1 / rank of candidate `gold` when candidates are ordered by scores (best first, ties by position); 0 beyond
    depth or when gold < 0 (not among the candidates)."""
    if gold < 0:
        return 0.0
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    rank = int(np.flatnonzero(order == gold)[0]) + 1
    return 1.0 / rank if rank <= depth else 0.0


def fit_threshold(gaps: np.ndarray, rr_dense: np.ndarray, rr_rerank: np.ndarray, budget: float = 0.001) -> dict:
    """The lowest gap threshold whose skipped questions (gap >= threshold) lose at most `budget` of mean reciprocal
    rank over all questions (loss = sum over skipped of rr_rerank - rr_dense, / n). Returns the threshold (inf when
    no question can be skipped), the skip rate and the loss at it."""
    gaps = np.asarray(gaps, dtype=np.float64)
    n = len(gaps)
    if n == 0:
        raise ValueError("gaps must not be empty")
    if not (len(rr_dense) == len(rr_rerank) == n):
        raise ValueError("gaps, rr_dense and rr_rerank must have the same length")
    if budget < 0:
        raise ValueError(f"budget must be non-negative; got {budget}")
    order = np.argsort(-gaps, kind="stable")
    loss = np.cumsum((np.asarray(rr_rerank, np.float64) - np.asarray(rr_dense, np.float64))[order]) / n
    best = 0
    for p in range(1, n + 1):
        # a threshold can only cut between distinct gaps: skip the first p only where gap p differs from gap p+1
        if p < n and gaps[order[p]] == gaps[order[p - 1]]:
            continue
        if loss[p - 1] <= budget + 1e-12:
            best = p
    if best == 0:
        return {"threshold": float("inf"), "skip_rate": 0.0, "mrr_loss": 0.0}
    lowest_skipped = gaps[order[best - 1]]
    next_gap = gaps[order[best]] if best < n else lowest_skipped - 1e-3
    return {"threshold": float((lowest_skipped + next_gap) / 2), "skip_rate": best / n,
            "mrr_loss": float(loss[best - 1])}


def apply(gaps: np.ndarray, rr_dense: np.ndarray, rr_rerank: np.ndarray, threshold: float) -> dict:
    """MRR with and without the rule, and its skip rate, on any split."""
    skip = np.asarray(gaps, dtype=np.float64) >= threshold
    rr = np.where(skip, rr_dense, rr_rerank)
    return {"skip_rate": float(skip.mean()), "mrr_adaptive": float(np.mean(rr)),
            "mrr_reranked": float(np.mean(rr_rerank)), "mrr_dense": float(np.mean(rr_dense)),
            "mrr_drop": float(np.mean(rr_rerank) - np.mean(rr))}


def candidate_ranks(questions: list[str], golds: list[str], corpus: list[str], embedder, reranker,
                    candidates: int = 20, progress: bool = True) -> dict[str, np.ndarray]:
    """Per question: the dense gap, and the reciprocal rank (@10) of its gold passage under the dense and the
    reranked order of the `candidates` nearest passages (exact search)."""
    from tqdm.auto import tqdm

    position = {t: i for i, t in enumerate(corpus)}
    corpus_emb = embedder.embed(corpus)
    q_emb = embedder.embed(list(questions))
    gaps, rr_d, rr_r = [], [], []
    for q, qv, gold_text in tqdm(list(zip(questions, q_emb, golds)), desc="reranking", unit="q", disable=not progress):
        scores = corpus_emb @ qv
        top = np.argsort(-scores, kind="stable")[:candidates]
        dense = scores[top].astype(np.float32)
        hits = np.flatnonzero(top == position[gold_text])
        gold = int(hits[0]) if len(hits) else -1
        fused = reranker.score(q, [corpus[i] for i in top], dense)
        gaps.append(float(dense[0] - dense[1]) if len(dense) > 1 else 0.0)
        rr_d.append(reciprocal_rank(dense, gold))
        rr_r.append(reciprocal_rank(fused, gold))
    return {"gap": np.array(gaps), "rr_dense": np.array(rr_d), "rr_rerank": np.array(rr_r)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=0.001, help="train MRR@10 the rule may lose (default 0.001)")
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--backend", default="auto", help="encoder backend to fit with (default auto)")
    p.add_argument("--reranker", type=Path, default=None,
                   help="reranker folder to fit the rule for (default: the packaged default reranker)")
    p.add_argument("--card", type=Path, default=None, help="card to write (default: that reranker's own)")
    p.add_argument("--dry-run", action="store_true", help="print the rule, write nothing")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))

    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import load_nq_open, passage_text
    from certrag.embed import Embedder, EmbeddingCache
    from certrag.home import certrag_home
    from certrag.rerank import PACKAGE_RERANKER, CrossEncoderReranker

    folder = args.reranker or PACKAGE_RERANKER
    reranker = CrossEncoderReranker(folder, backend=args.backend)
    embedder = Embedder(backend=args.backend,
                        cache=EmbeddingCache(certrag_home() / "embeddings-all-MiniLM-L6-v2.safetensors"))
    train = load_nq_open(split="train")
    corpus = sorted({it.gold_text for it in train} | {passage_text(t, x) for t, x, _ in wiki_leads()})
    ranks = candidate_ranks([it.question for it in train], [it.gold_text for it in train], corpus, embedder,
                            reranker, args.candidates)
    fit = fit_threshold(ranks["gap"], ranks["rr_dense"], ranks["rr_rerank"], args.budget)
    on_train = apply(ranks["gap"], ranks["rr_dense"], ranks["rr_rerank"], fit["threshold"])
    rule = {"feature": "dense_gap (cos_1 - cos_2 of the dense candidates)", "threshold": fit["threshold"],
            "budget_mrr10": args.budget, "fitted_on": f"NQ-open train split, {len(train)} questions, "
            f"{len(corpus)} passages, {args.candidates} candidates", "backend": reranker.backend.backend,
            "train_skip_rate": on_train["skip_rate"], "train_mrr10_reranked": on_train["mrr_reranked"],
            "train_mrr10_adaptive": on_train["mrr_adaptive"],
            "command": "python -m certrag.train.skip_rule" + (f" --reranker {folder}" if args.reranker else "")}
    print(json.dumps(rule, indent=2))
    if args.dry_run:
        return
    card_path = args.card or folder / "card.json"
    card = json.loads(card_path.read_text())
    card["skip_rule"] = rule
    tmp = card_path.with_name(card_path.name + ".tmp")
    tmp.write_text(json.dumps(card, indent=2) + "\n")
    tmp.replace(card_path)
    print(f"wrote the skip rule into {card_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
