"""Abstention out of the box: how often the default certification (shipped with the reranker, made on the NQ-open
calibration split; certrag.train.default_calibration) flags a question as not supported by the store.

Store: benchmarks/_nq.py's (every NQ-open gold passage and the bundled Wikipedia leads, one chunk per passage), with
no calibration of its own, so the engine uses the shipped default. Questions: the NQ-open *test* split. Answerable:
the store as it is (each question's gold passage in it). Off-topic: the same question on a store without any passage
that answers it -- its candidates with every correct one removed (certrag.certify.calibration.ChunkJudge: the gold
passage, or a passage holding a gold answer), which is what such a store returns at the top (the best remaining
candidate is the same whatever would have filled the gap below it). Flagged: Engine.support says not supported (the
best candidate scores below the calibration's threshold). Targets (issue 32): off-topic flagged >= 80%, answerable
flagged <= 10%.

    python benchmarks/bench_abstention.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    _common.pin_threads(2)

    import dataclasses

    import numpy as np

    from certrag.certify.calibration import ChunkJudge, load_calibration_items
    from certrag.rerank import CrossEncoderReranker

    from _nq import cached_embedder, cached_retrievals, nq_store

    reranker = CrossEncoderReranker.default()
    engine, _ = nq_store(cached_embedder(), reranker)
    cal = engine.calibration
    if cal is None or not cal.source:
        raise SystemExit("the store must have no calibration of its own, and a default must ship with the reranker")
    items = load_calibration_items("nq-open:test")
    results = cached_retrievals(engine, reranker, [it.question for it in items], args.candidates,
                                "test_candidates.json")
    judge = ChunkJudge(answer_threshold=cal.answer_threshold, source_threshold=cal.source_threshold,
                       span_tokens=cal.span_tokens)
    answerable, offtopic, best_on, best_off = [], [], [], []
    for item, r in zip(items, results):
        correct = judge.correct(item, r.doc_ids, r.texts)
        answerable.append(not engine.support(r)["supported"])
        keep = ~correct
        if keep.any():
            without = dataclasses.replace(r, chunk_ids=r.chunk_ids[keep], doc_ids=tuple(np.array(r.doc_ids)[keep]),
                                          texts=tuple(np.array(r.texts, dtype=object)[keep]),
                                          dense_scores=r.dense_scores[keep], rerank_scores=r.rerank_scores[keep],
                                          selected=int(keep.sum()))
            offtopic.append(not engine.support(without)["supported"])
            best_off.append(float(np.max(without.rerank_scores)))
        best_on.append(float(np.max(r.rerank_scores)))
    on, off = np.array(best_on), np.array(best_off)
    sweep = [{"threshold": float(t), "answerable_flagged": float((on < t).mean()),
              "offtopic_flagged": float((off < t).mean())} for t in (8.0, 9.0, 10.0, cal.s_thres, 11.0, 12.0, 13.0)]
    row = {"questions": len(items), "offtopic_questions": len(offtopic), "threshold": cal.s_thres,
           "alpha": cal.alpha, "answerable_flagged": float(np.mean(answerable)),
           "offtopic_flagged": float(np.mean(offtopic)),
           "best_score_median": {"answerable": float(np.median(best_on)), "offtopic": float(np.median(best_off))},
           "sweep": sweep}
    print(row)
    if args.no_write:
        return
    meta = _common.meta({"store": "benchmarks/_nq.py", "calibration": cal.source, "candidates": args.candidates})
    _common.write_rows("bench_abstention", [row], meta)
    ok_off, ok_on = row["offtopic_flagged"] >= 0.8, row["answerable_flagged"] <= 0.1
    md = ["## Abstention out of the box: the shipped NQ-open certification on a store without its own "
          "(bench_abstention.py)\n",
          f"NQ-open test split, {len(items):,} questions; default reranker; threshold {cal.s_thres:.3f} (alpha "
          f"{cal.alpha}, made on the calibration split). Flagged: the best candidate below the threshold "
          "(Engine.support; `certify=True` then answers \"unknown\" without an LLM call).\n",
          _common.markdown_table(
              ["questions", "flagged", "target", "met", "median best score"],
              [[f"answerable ({len(answerable):,}, gold passage in the store)", f"{row['answerable_flagged']:.1%}",
                "<= 10%", "yes" if ok_on else "**no**", f"{row['best_score_median']['answerable']:.2f}"],
               [f"off-topic ({len(offtopic):,}, every answering passage removed)", f"{row['offtopic_flagged']:.1%}",
                ">= 80%", "yes" if ok_off else "**no**", f"{row['best_score_median']['offtopic']:.2f}"]]),
          "\nThe same two rates at other thresholds (what a stricter flag would cost; only the calibrated one carries "
          "the conformal statement):\n",
          _common.markdown_table(["threshold", "answerable flagged", "off-topic flagged"],
                                 [[f"{r['threshold']:.2f}" + (" (calibrated)" if r["threshold"] == cal.s_thres else ""),
                                   f"{r['answerable_flagged']:.1%}", f"{r['offtopic_flagged']:.1%}"] for r in sweep])]
    _common.update_results_md("bench_abstention", "\n".join(md) + "\n" + _common.footer(meta))
    print("\n".join(md))


if __name__ == "__main__":
    main()
