"""Certified retrieval on NQ-open: calibrate on the calibration split, measure on the test split.

Store: the NQ-open gold passages + Wikipedia leads of bench_retrieval.py (one chunk per passage), 20 reranked
candidates per question. A candidate is correct when it is the question's gold passage or holds a gold answer
(certrag.certify.calibration.ChunkJudge: a short answer, up to 4 tokens, as a whole token span; a longer one by
RougeL recall >= 0.8); how many questions each rule finds a correct candidate for is reported, beside the old rule
(RougeL recall for every answer). Three retrievers: the default (cross-encoder, its fused logit as the score), the
bi-encoder alone (the cosine over the same candidates, re-sorted), and a failing one -- the default with the gold
passage of every other question missing from the store (its candidates without the gold passage, as a store
lacking those documents returns them), the certification paper's case where m1 must warn.

For alpha in {0.05, 0.1, 0.2}: s_thres from the 533 calibration questions; on the 1,081 test questions the empirical
coverage beside 1 - alpha, m1, m2, the mean trusted-set size and its context tokens. Then answers with the bundled
reader (plain strategy) on the first --questions test questions, with the default selection (EngineConfig's) and with
the context filtered to the trusted set at alpha = 0.1: EM, F1, reject rate (no trusted chunk -> "unknown"), tokens.
Reproduces the shape of the certification paper's retrieval-stage table (coverage and m1/m2 against 1 - alpha).

    python benchmarks/bench_conformal.py --questions 150
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

ALPHAS = (0.05, 0.1, 0.2)
SWEEP = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=150, help="test questions answered by the LLM (0 = skip)")
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    _common.pin_threads(1)

    import numpy as np

    from certrag.certify.calibration import CalibrationItem, ChunkJudge, coverage_sweep, plot_sweep
    from certrag.certify.conformal import ScoredItems, calibrated_scores, diagnose, threshold
    from certrag.eval.metrics import exact_match, f1_score
    from certrag.data.nq import load_nq_open
    from certrag.rerank import CrossEncoderReranker

    from _nq import cached_embedder, cached_retrievals, nq_store

    reranker = CrossEncoderReranker.default()
    engine, corpus = nq_store(cached_embedder(), reranker)
    gold_doc = {d.text: d.id for d in corpus}
    tokens = {int(c["id"]): c["n_tokens"] for c in engine._data.chunks}
    splits = {s: load_nq_open(split=s) for s in ("calibration", "test")}
    results = {"calibration": cached_retrievals(engine, reranker, [it.question for it in splits["calibration"]],
                                                args.candidates, "calibration_candidates.json"),
               "test": cached_retrievals(engine, reranker, [it.question for it in splits["test"]], args.candidates,
                                         "retrieval_candidates.json")}
    judge, old_judge = ChunkJudge(), ChunkJudge(span_tokens=0)  # old: RougeL recall >= 0.8 for every answer
    correct, rule_counts = {}, {}
    for s, items in splits.items():
        correct[s], counts = [], {}
        for it, r in zip(items, results[s]):
            item = CalibrationItem(question=it.question, answers=it.answers, source_id=gold_doc[it.gold_text])
            rules = judge.by_rule(item, r.doc_ids, r.texts)
            correct[s].append(np.logical_or.reduce(list(rules.values())))
            old = old_judge.by_rule(item, r.doc_ids, r.texts)
            for name, hit in (*rules.items(), ("any rule", correct[s][-1]),
                              ("old: RougeL recall for every answer", old["answer_rougeL"])):
                counts[name] = counts.get(name, 0) + int(hit.any())
            counts["answer rules, candidates marked (new / old)"] = (
                counts.get("answer rules, candidates marked (new / old)", (0, 0))[0]
                + int((rules["answer_span"] | rules["answer_rougeL"]).sum()),
                counts.get("answer rules, candidates marked (new / old)", (0, 0))[1] + int(old["answer_rougeL"].sum()))
        rule_counts[s] = counts
    print(rule_counts, file=sys.stderr)

    def scored(split: str, retriever: str) -> tuple[ScoredItems, list]:
        out, orders = ScoredItems(), []
        for qi, (r, c) in enumerate(zip(results[split], correct[split])):
            if retriever == "half missing":  # every other question's gold passage is not in the store
                gold = splits[split][qi].gold_text
                order = (np.array([i for i, t in enumerate(r.texts) if t != gold]) if qi % 2
                         else np.arange(len(r.chunk_ids)))
                sc = calibrated_scores(r.rerank_scores[order], r.dense_scores[order], "rerank logit")
            elif retriever == "reranked":
                order = np.arange(len(r.chunk_ids))
                sc = calibrated_scores(r.rerank_scores, r.dense_scores, "rerank logit")
            else:
                order = np.argsort(-r.dense_scores, kind="stable")
                sc = calibrated_scores(r.rerank_scores, r.dense_scores[order], "cosine")
            out.scores.append(sc)
            out.correct.append(c[order])
            orders.append(order)
        return out, orders

    rows, sweeps = [], {}
    for retriever in ("reranked", "dense", "half missing"):
        cal, _ = scored("calibration", retriever)
        test, orders = scored("test", retriever)
        sweeps[retriever] = coverage_sweep(cal, test, SWEEP)
        for alpha in ALPHAS:
            s = threshold(cal.best_correct(), alpha)
            d = diagnose(test, s, alpha)
            ctx = []
            for r, order, sc in zip(results["test"], orders, test.scores):
                kept = order[: int((sc >= s).sum()) if s is not None else len(order)]
                ctx.append(sum(tokens[int(r.chunk_ids[i])] for i in kept))
            rows.append({"what": "conformal", "retriever": retriever, "alpha": alpha, "target": 1 - alpha,
                         "s_thres": s, "n_cal": len(cal.scores), "n_test": d.n_eval, "coverage": d.coverage,
                         "conditional_coverage": d.conditional_coverage,
                         "cal_without_correct": int(np.isinf(cal.best_correct()).sum()),
                         "m1": d.m1, "m2": d.m2, "mean_trusted": d.mean_trusted, "context_tokens": float(np.mean(ctx)),
                         "retrieval_recall": d.retrieval_recall, "holds": d.holds, "reasons": list(d.reasons)})
            print(rows[-1], file=sys.stderr)

    sweeps.pop("half missing")
    plot = plot_sweep(sweeps["reranked"], _common.RESULTS_DIR / "conformal_coverage.png",
                      title=f"NQ-open test ({len(splits['test'])} q), reranked top-{args.candidates}")

    # Answers with and without the conformal filter (alpha = 0.1, reranked retriever).
    qa = []
    if args.questions:
        from certrag.config import EngineConfig
        from certrag.llm import LocalLLM
        from certrag.llm.prompts import Passage
        from certrag.select import cut
        from certrag.strategies import STRATEGIES

        llm = LocalLLM(args.model)
        plain = STRATEGIES["plain"]()
        cal, _ = scored("calibration", "reranked")
        s_thres = threshold(cal.best_correct(), 0.1)
        selector = EngineConfig().selection.make()
        max_k = EngineConfig().selection.max_k
        default = f"default selection ({EngineConfig().selection.method})"
        conditions = {default: [], "conformal filter alpha=0.1": []}
        for it, r in zip(splits["test"][: args.questions], results["test"][: args.questions]):
            sc = calibrated_scores(r.rerank_scores, r.dense_scores, "rerank logit")
            n_sel = {default: cut(selector, r.rerank_scores, "logit"),
                     "conformal filter alpha=0.1": min(int((sc >= s_thres).sum()), max_k)}
            for name, n in n_sel.items():
                t = time.perf_counter()
                if n == 0:
                    text, tin, tout, rejected = "unknown", 0, 0, True
                else:
                    res = plain.run(it.question, [Passage(text=r.texts[i], chunk_id=int(r.chunk_ids[i]))
                                                  for i in range(n)], llm)
                    text, tin, tout, rejected = res.text, res.input_tokens, res.output_tokens, res.rejected
                conditions[name].append({"em": exact_match(text, it.answers), "f1": f1_score(text, it.answers),
                                         "rejected": rejected, "in": tin, "out": tout, "chunks": n,
                                         "s": time.perf_counter() - t})
        for name, rs in conditions.items():
            answered = [x for x in rs if not x["rejected"]]
            qa.append({"what": "conformal_qa", "condition": name, "questions": len(rs),
                       "em": float(np.mean([x["em"] for x in rs])), "f1": float(np.mean([x["f1"] for x in rs])),
                       "em_answered": float(np.mean([x["em"] for x in answered])) if answered else None,
                       "reject_rate": float(np.mean([x["rejected"] for x in rs])),
                       "mean_chunks": float(np.mean([x["chunks"] for x in rs])),
                       "input_tokens": float(np.mean([x["in"] for x in rs])),
                       "output_tokens": float(np.mean([x["out"] for x in rs])),
                       "p50_s": float(np.median([x["s"] for x in rs]))})
            print(qa[-1], file=sys.stderr)

    meta = _common.meta({"bench": "bench_conformal", "chunks": len(engine), "candidates": args.candidates,
                         "reranker": reranker.card.get("name"), "model": args.model if args.questions else None})
    fmt = lambda x: "unbounded" if x is None else x  # noqa: E731
    main_rows = [r for r in rows if r["retriever"] == "reranked"]
    verdict = "; ".join(f"alpha {r['alpha']}: coverage {r['coverage']:.3f} vs {r['target']:.2f} "
                        f"({'holds' if r['holds'] else 'does NOT hold'})" for r in main_rows)
    parts = [
        "### Certified retrieval (bench_conformal.py)\n",
        f"**Verdict (reranked retriever):** {verdict}.\n",
        f"Calibrated on the {len(splits['calibration'])} NQ-open calibration questions, measured on the "
        f"{len(splits['test'])} test questions; {args.candidates} candidates per question from the store of "
        f"bench_retrieval.py ({len(engine):,} chunks). The threshold is the split-conformal quantile over the "
        "calibration questions whose candidates hold a correct chunk ('left out' counts the others). Coverage: a "
        "correct candidate among the trusted ones, over all test questions; conditional: over those whose "
        "candidates hold one (the guaranteed quantity); m1: at least one trusted; m2: mean fraction of the "
        f"{args.candidates} candidates trusted; retrieval recall: a correct candidate among all {args.candidates} "
        f"(the ceiling on coverage).\n\n![coverage against alpha](results/{plot.name})\n",
        _common.markdown_table(
            ["retriever", "alpha", "1-alpha", "s_thres", "left out", "coverage", "conditional", "m1", "m2",
             "mean trusted", "context tokens", "retrieval recall", "verdict"],
            [[r["retriever"], r["alpha"], r["target"], fmt(r["s_thres"]), r["cal_without_correct"], r["coverage"],
              r["conditional_coverage"], r["m1"], r["m2"], r["mean_trusted"], r["context_tokens"],
              r["retrieval_recall"], "holds" if r["holds"] else "fails: " + "; ".join(r["reasons"])] for r in rows]),
        "\nQuestions with at least one correct candidate among the 20, by each rule of the judge (calibration / "
        "test): " + "; ".join(
            f"{name} {rule_counts['calibration'][name]} / {rule_counts['test'][name]}"
            for name in rule_counts["calibration"] if not name.startswith("answer rules")) +
        ". Candidates marked correct by the answer rules, new / old: calibration "
        f"{rule_counts['calibration']['answer rules, candidates marked (new / old)']}, test "
        f"{rule_counts['test']['answer rules, candidates marked (new / old)']}.\n",
    ]
    if not qa:
        parts.append("\nAnswers with and without the filter: not rerun in this run (--questions 0).\n")
    if qa:
        base, filt = qa
        parts += [
            f"\nAnswers (plain strategy, {meta['model']}, first {base['questions']} test questions): the default "
            "selection against the context filtered to the trusted set at alpha = 0.1 (at most max_k = 10 chunks; "
            "none trusted -> \"unknown\", a rejection, no LLM call). "
            f"Filtering changes EM by {filt['em'] - base['em']:+.3f} and F1 by {filt['f1'] - base['f1']:+.3f}.\n",
            _common.markdown_table(
                ["condition", "questions", "EM", "F1", "EM of answered", "reject rate", "mean chunks", "input tokens",
                 "output tokens", "p50 s"],
                [[x["condition"], x["questions"], x["em"], x["f1"], x["em_answered"], x["reject_rate"],
                  x["mean_chunks"], x["input_tokens"], x["output_tokens"], x["p50_s"]] for x in qa])]
    parts.append(_common.footer(meta))
    text = "\n".join(parts)
    print(text)
    engine.close()
    if not args.no_write:
        _common.write_rows("bench_conformal", rows + qa, meta)
        _common.update_results_md("bench_conformal", text)


if __name__ == "__main__":
    main()
