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
    p.add_argument("--reranker", default=None, help="a packaged reranker other than the default (its own "
                   "shipped calibration is used)")
    p.add_argument("--answers", type=int, default=0,
                   help="also answer this many train and test questions both ways with the reader (confidence=True) "
                   "and measure a flag that adds the answer's P(correct) to the retrieval score (slow: about "
                   "4 x answers generations)")
    p.add_argument("--engine-answers", type=int, default=0,
                   help="also answer this many test questions both ways as a user's call does "
                   "(engine.answer(certify=True), the default reader and strategy) and report how often the answer is "
                   "rejected: the retrieval flag, or the reader saying unknown (about 1.4 x this many generations)")
    p.add_argument("--judge-support", action="store_true",
                   help="--engine-answers also with judge_support=True: the answer-presence rule shipped with the "
                   "reranker (certrag.certify.presence) decides support, and certify answers \"unknown\" where it "
                   "says not supported")
    p.add_argument("--unknown-probe", type=train_test_counts, default=None, metavar="TRAIN,TEST",
                   help="TRAIN,TEST: also read the reader's probability that its answer starts with 'unknown' "
                   "(one prefill, the default selection's passages) for this many train and test questions both ways, "
                   "and measure a flag that adds it to the best retrieval score")
    p.add_argument("--probe-prompt", choices=("plain", "strict"), default="plain",
                   help="the probe's prompt: the plain strategy's, or one that allows only the passages' facts")
    p.add_argument("--presence-judge", type=train_test_counts, default=None, metavar="CAL,TEST",
                   help="CAL,TEST: also ask a reader whether the best candidate states the answer (its log-odds of "
                   "'yes' against 'no', one prefill) for this many calibration and test questions both ways, and "
                   "measure a flag that adds it to the best retrieval score, fitted on the calibration split")
    p.add_argument("--judge-model", default="qwen2.5-coder-1.5b-instruct",
                   help="--presence-judge's reader (q8 weights, one thread)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    _common.pin_threads(2)

    import numpy as np

    from certrag.certify.calibration import ChunkJudge, load_calibration_items
    from certrag.rerank import CrossEncoderReranker

    from _nq import cached_embedder, cached_retrievals, nq_store

    reranker = CrossEncoderReranker.default(name=args.reranker) if args.reranker else CrossEncoderReranker.default()
    suffix = f"_{args.reranker}" if args.reranker else ""
    engine, _ = nq_store(cached_embedder(), reranker)
    cal = engine.calibration
    if cal is None or not cal.source:
        raise SystemExit("the store must have no calibration of its own, and a default must ship with the reranker")
    items = load_calibration_items("nq-open:test")
    results = cached_retrievals(engine, reranker, [it.question for it in items], args.candidates,
                                f"test_candidates{suffix}.json")
    judge = ChunkJudge(answer_threshold=cal.answer_threshold, source_threshold=cal.source_threshold,
                       span_tokens=cal.span_tokens)

    answerable, offtopic, best_on, best_off = [], [], [], []
    pairs = [both_ways_of(judge, item, r) for item, r in zip(items, results)]
    for r, without in pairs:
        answerable.append(not engine.support(r)["supported"])
        if without is not None:
            offtopic.append(not engine.support(without)["supported"])
            best_off.append(float(np.max(without.rerank_scores)))
        best_on.append(float(np.max(r.rerank_scores)))
    on, off = np.array(best_on), np.array(best_off)
    train = load_calibration_items("nq-open:train")
    train_results = cached_retrievals(engine, reranker, [it.question for it in train], args.candidates,
                                      f"train_candidates{suffix}.json")
    train_pairs = [both_ways_of(judge, it, r) for it, r in zip(train, train_results)]
    richer = richer_flag(train_pairs, pairs)
    with_answer = (answer_flag(engine, reranker, (train, train_pairs), items, pairs, args, suffix) if args.answers
                   else None)
    end_to_end = ([engine_rejections(engine, reranker, items, pairs, args, suffix, judged)
                   for judged in ((False, True) if args.judge_support else (False,))] if args.engine_answers else [])
    probe = (unknown_flag(engine, reranker, (train, train_pairs), items, pairs, args, suffix) if args.unknown_probe
             else None)
    sweep = [{"threshold": float(t), "answerable_flagged": float((on < t).mean()),
              "offtopic_flagged": float((off < t).mean())} for t in (8.0, 9.0, 10.0, cal.s_thres, 11.0, 12.0, 13.0)]
    presence = presence_flag(engine, reranker, items, pairs, args, judge) if args.presence_judge else None
    row = {"reranker": reranker.name, "questions": len(items), "offtopic_questions": len(offtopic),
           "threshold": cal.s_thres, "richer_flag": richer, "answer_flag": with_answer, "end_to_end": end_to_end,
           "unknown_probe": probe, "presence_judge": presence,
           "alpha": cal.alpha, "answerable_flagged": float(np.mean(answerable)),
           "offtopic_flagged": float(np.mean(offtopic)),
           "best_score_median": {"answerable": float(np.median(best_on)), "offtopic": float(np.median(best_off))},
           "sweep": sweep}
    print(row)
    if args.no_write:
        return
    meta = _common.meta({"store": "benchmarks/_nq.py", "calibration": cal.source, "candidates": args.candidates})
    _common.write_rows(f"bench_abstention{suffix}", [row], meta)
    ok_off, ok_on = row["offtopic_flagged"] >= 0.8, row["answerable_flagged"] <= 0.1
    md = ["## Abstention out of the box: the shipped NQ-open certification on a store without its own "
          "(bench_abstention.py)\n",
          f"NQ-open test split, {len(items):,} questions; reranker {reranker.name}; threshold {cal.s_thres:.3f} (alpha "
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
                                   f"{r['answerable_flagged']:.1%}", f"{r['offtopic_flagged']:.1%}"] for r in sweep]),
          "\nCould a richer flag from retrieval alone meet the target? A logistic regression over five features of "
          "the candidates' scores (best fused score, its gap to the second, the mean of the best three, the best "
          "dense cosine, the best score minus the median), fitted on the NQ-open *train* split (answerable and "
          "answer-removed versions of 1,041 questions), its threshold set where it flags 10% of train's answerable "
          "questions; beside it the best score alone at the same train operating point. Measured on test; not "
          "shipped:\n",
          flag_table(richer)]
    if with_answer:
        md += ["\nCould the answer itself add to the flag? The reader answers each question twice (the store as it "
               "is, and without its answering passages) with `confidence=True`, on the first "
               f"{with_answer['train_questions']} train and {with_answer['test_questions']} test questions that have "
               "both versions; a logistic regression over (best fused score, the answer's P(correct) from the shipped "
               "classifier) is fitted on those train answers, its threshold where it flags 10% of their answerable "
               "ones; beside it the rule `retrieval flag (calibrated threshold) or P(correct) below c`, c chosen on "
               "train the same way, and the best score alone on the same questions. Measured on test; not shipped:\n",
               flag_table(with_answer["flags"]),
               f"\nShare of answers containing a reference answer: answerable {with_answer['correct_on']:.2f}, "
               f"off-topic {with_answer['correct_off']:.2f} (test); seconds per answer "
               f"{with_answer['seconds_per_answer']:.2f}."]
    for e in end_to_end:
        how = ("`engine.answer(question, certify=True, judge_support=True)`" if e["judged"]
               else "`engine.answer(question, certify=True)`")
        flag = "the presence rule or no trusted candidate (no LLM call)" if e["judged"] else "the retrieval flag"
        md += ["\nWhat a user's call says: the first "
               f"{e['questions']} test questions that have an off-topic version, each answered both ways by "
               f"{how} ({e['reader']}, strategy plain, the shipped calibration"
               + (" and presence rule" if e["judged"] else "") + "). Rejected: the answer is \"unknown\" -- either "
               + ("the shipped answer-presence rule says not supported or no candidate is trusted" if e["judged"]
                  else "no candidate is trusted") + " (no LLM call) or the reader, given the trusted candidates, says "
               "it cannot answer. Flagged: `Answer.support` says not supported. 95% intervals: bootstrap over "
               "questions.\n",
               _common.markdown_table(
                   ["questions", "rejected", f"by {flag}", "by the reader", "target", "met", "flagged",
                    "answer holds a reference answer"],
                   [[f"{way} ({e['questions']})", f"{e[way]['rejected']:.1%} [{e[way]['ci'][0]:.1%}, "
                     f"{e[way]['ci'][1]:.1%}]", f"{e[way]['by_retrieval']:.1%}", f"{e[way]['by_reader']:.1%}",
                     target, "yes" if ok else "**no**",
                     "-" if e[way].get("flagged") is None else f"{e[way]['flagged']:.1%}", f"{e[way]['correct']:.2f}"]
                    for way, target, ok in (("answerable", "<= 10%", e["answerable"]["rejected"] <= 0.1),
                                            ("off-topic", ">= 80%", e["off-topic"]["rejected"] >= 0.8))]),
               f"\nSeconds per answer (median of those that called the LLM, the judge included when judged): "
               f"{e['seconds_per_answer']:.2f}."]
    if probe:
        md += ["\nDoes the reader know when the passages do not hold the answer? Its probability that the answer "
               f"starts with \"unknown\" ({probe['reader']}, one prefill over the default selection's passages, the "
               f"{'plain strategy' if probe['prompt'] == 'plain' else 'passages-only'} prompt), read on the first "
               f"{probe['train_questions']} train and {probe['test_questions']} test questions that have both "
               "versions; a logistic regression over (best fused score, log P(unknown)) fitted on the train ones, its "
               "threshold where it flags 10% of their answerable ones; beside it the rule `calibrated retrieval flag "
               "or P(unknown) above c`, c chosen on train the same way. Measured on test; not shipped:\n",
               flag_table(probe["flags"]),
               f"\nP(unknown) alone, test AUROC (answerable against off-topic): {probe['auroc_alone']:.3f}."]
    if presence:
        md += ["\nDoes a reader, asked outright, tell a passage that states the answer from a same-subject one that "
               f"does not? {presence['reader']} (q8) reads the best candidate and the question and is asked \"Does the "
               "passage state the answer to the question? Reply with yes or no only.\"; the signal is its log-odds of "
               f"yes against no (one prefill). On the first {presence['calibration_questions']} calibration and "
               f"{presence['test_questions']} test questions, both ways; a logistic regression over (best fused score, "
               "log-odds) is fitted on the calibration ones (the split the shipped certification is made on), its "
               "threshold where it flags 10% of their answerable ones; beside it the best score alone at the same "
               "calibration operating point, and the rule `calibrated retrieval flag or log-odds below c`. Measured on "
               "test. The regression ships as `judge_support=True` (certrag.certify.presence; fitted by `python -m "
               "certrag.train.presence_rule` on every calibration question with an off-topic version): when its file is "
               "in the package, its row comes last:\n",
               flag_table(presence["flags"], "calibration"),
               f"\nThe log-odds alone, test AUROC (answerable against off-topic): {presence['auroc_alone']:.3f}; "
               + (f"seconds per judgment (median of the {presence['judged_now']} made by this run, the rest cached; "
                  f"one thread): {presence['seconds_per_judgment']:.2f}." if presence["judged_now"] else
                  "every judgment came from the cache (about 1.9 s each on one thread when made).")]
    name = f"bench_abstention{suffix}"
    _common.update_results_md(name, "\n".join(md) + "\n" + _common.footer(meta))
    print("\n".join(md))


def or_rule_threshold(s_thres: float, best, doubt) -> float:
    """The smallest c (among train's values) whose rule `best < s_thres or doubt > c` flags at most 10% of train's
    answerable questions (best: their best scores; doubt: a signal that grows as the answer looks unsupported);
    0.0 when none does."""
    import numpy as np

    cs = [c for c in np.unique(doubt) if np.mean((best < s_thres) | (doubt > c)) <= 0.10]
    return float(min(cs)) if cs else 0.0


def or_rule(flag: str, train_threshold: float, s_thres: float, on: tuple, off: tuple, c: float) -> dict:
    """The rule `best < s_thres or doubt > c` on test: on / off are (best scores, doubts) of the answerable and
    off-topic questions."""
    import numpy as np

    def rate(best, doubt):
        return float(np.mean((best < s_thres) | (doubt > c)))

    return {"flag": flag, "train_threshold": train_threshold, "answerable_flagged": rate(*on),
            "offtopic_flagged": rate(*off), "auroc": None}


def flag_table(flags: list[dict], fitted_on: str = "train") -> str:
    """Flags measured on test (fitted_flags' rows) as a markdown table."""
    return _common.markdown_table(
        [f"flag (threshold from {fitted_on})", "answerable flagged (test)", "off-topic flagged (test)", "AUROC (test)"],
        [[r["flag"], f"{r['answerable_flagged']:.1%}", f"{r['offtopic_flagged']:.1%}",
          f"{r['auroc']:.3f}" if r["auroc"] is not None else "-"] for r in flags])


def both_ways_of(judge, item, r) -> tuple:
    """(the retrieval as it is, the retrieval without its correct candidates (judge: a ChunkJudge) or None)."""
    from certrag.certify.calibration import without_correct

    return r, without_correct(judge, item, r)


def both_versions(items, pairs) -> list[tuple]:
    """(item, retrieval as it is, retrieval without its correct candidates) for the questions that have both."""
    return [(it, r, w) for it, (r, w) in zip(items, pairs) if w is not None and len(w.rerank_scores)]


def train_test_counts(text: str) -> tuple[int, int]:
    """--unknown-probe's TRAIN,TEST and --presence-judge's CAL,TEST: two positive counts."""
    try:
        n_train, n_test = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes two counts, as 300,300; got {text!r}") from None
    if n_train < 1 or n_test < 1:
        raise argparse.ArgumentTypeError(f"both counts must be positive; got {text!r}")
    return n_train, n_test


def features(r) -> list[float]:
    """Five numbers from a retrieval's candidate scores."""
    import numpy as np

    s = np.sort(np.asarray(r.rerank_scores, dtype=float))[::-1]
    d = np.sort(np.asarray(r.dense_scores, dtype=float))[::-1]
    return [s[0], s[0] - (s[1] if len(s) > 1 else s[0]), float(s[:3].mean()), d[0], s[0] - float(np.median(s))]


def richer_flag(train_pairs, test_pairs) -> list[dict]:
    """The feature flag fitted on train, and the best score alone at the same train operating point, on test."""
    import numpy as np

    def matrix(pairs):
        on = [features(r) for r, _ in pairs]
        off = [features(w) for _, w in pairs if w is not None and len(w.rerank_scores) >= 3]
        return np.array(on), np.array(off)

    return fitted_flags("five retrieval features, logistic regression", matrix(train_pairs), matrix(test_pairs))


def fitted_flags(name: str, train: tuple, test: tuple) -> list[dict]:
    """Two flags measured on test (answerable, off-topic feature rows; the best fused score first): the best score
    alone, and a logistic regression over every feature fitted on train (answerable against off-topic), each
    flagging below its threshold at train's 10% answerable flagged."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from certrag.train.factuality import auroc

    (tr_on, tr_off), (te_on, te_off) = train, test
    scaler = StandardScaler().fit(np.r_[tr_on, tr_off])
    model = LogisticRegression(max_iter=1000).fit(scaler.transform(np.r_[tr_on, tr_off]),
                                                  np.r_[np.ones(len(tr_on)), np.zeros(len(tr_off))])
    out = []
    for flag, score in (("best fused score alone", lambda x: x[:, 0]),
                        (name, lambda x: model.decision_function(scaler.transform(x)))):
        t = float(np.quantile(score(tr_on), 0.10))
        on, off = score(te_on), score(te_off)
        out.append({"flag": flag, "train_threshold": t, "answerable_flagged": float(np.mean(on < t)),
                    "offtopic_flagged": float(np.mean(off < t)),
                    "auroc": auroc(np.r_[np.ones(len(on)), np.zeros(len(off))], np.r_[on, off])})
    return out


def keyed_cache(name: str, key: dict, field: str) -> tuple[Path, dict]:
    """benchmarks/data/<name> and its JSON when it was made under `key`; else a fresh {"key": key, field: {}}."""
    import json

    path = _common.DATA_DIR / name
    cache = json.loads(path.read_text()) if path.exists() else {}
    return path, (cache if cache.get("key") == key else {"key": key, field: {}})


def save_cache(path: Path, cache: dict) -> None:
    import json

    from certrag.atomic import write_file_atomic

    write_file_atomic(path, json.dumps(cache).encode())


def answer_flag(engine, reranker, train, test_items, test_pairs, args, suffix) -> dict:
    """Answers the first args.answers train and test questions (those with an off-topic version) both ways with
    confidence=True (cached in benchmarks/data by question, store way and reader), and measures flags that add the
    answer's P(correct) to the best retrieval score; thresholds from train, rates on test."""
    import dataclasses
    import time

    import numpy as np
    from tqdm.auto import tqdm

    from certrag.eval.metrics import answer_in_text
    from certrag.select import cut

    cache_path, cache = keyed_cache(f"abstention_answers{suffix}.json",
                                    {"reader": engine.llm.name, "reranker": reranker.name, "store": len(engine),
                                     "selection": repr(engine.config.selection)}, "answers")
    spent, selector = [], engine.config.selection.make()

    def answered(question, r, way):
        k = f"{way}\t{question}"
        if k not in cache["answers"]:
            # the candidates come whole (all kept): the engine's default selection cuts them, as a user's call would
            r = dataclasses.replace(r, selected=cut(selector, r.rerank_scores, "logit"))
            t0 = time.perf_counter()
            a = engine.answer(question, retrieval=r, confidence=True)
            spent.append(time.perf_counter() - t0)
            cache["answers"][k] = {"p_correct": a.p_correct, "text": a.text}
        return cache["answers"][k]

    def rows(items, pairs, desc):
        out = []
        chosen = both_versions(items, pairs)
        for it, r, w in tqdm(chosen[: args.answers], desc=desc):
            a_on, a_off = answered(it.question, r, "on"), answered(it.question, w, "off")
            out.append(((float(np.max(r.rerank_scores)), a_on["p_correct"]),
                        (float(np.max(w.rerank_scores)), a_off["p_correct"]),
                        (a_on["text"], a_off["text"], it.answers)))
        save_cache(cache_path, cache)
        return out

    tr = rows(*train, "train answers")
    te = rows(test_items, test_pairs, "test answers")
    tr_on, tr_off = np.array([x[0] for x in tr]), np.array([x[1] for x in tr])
    te_on, te_off = np.array([x[0] for x in te]), np.array([x[1] for x in te])
    flags = fitted_flags("best fused score + answer P(correct), logistic regression", (tr_on, tr_off),
                         (te_on, te_off))
    c = or_rule_threshold(engine.calibration.s_thres, tr_on[:, 0], -tr_on[:, 1])
    flags.append(or_rule(f"calibrated retrieval flag or P(correct) < {0.0 - c:.3f}", 0.0 - c,
                         engine.calibration.s_thres, (te_on[:, 0], -te_on[:, 1]), (te_off[:, 0], -te_off[:, 1]), c))
    return {"train_questions": len(tr), "test_questions": len(te), "flags": flags,
            "correct_on": float(np.mean([answer_in_text(x[2][0], x[2][2]) for x in te])),
            "correct_off": float(np.mean([answer_in_text(x[2][1], x[2][2]) for x in te])),
            "seconds_per_answer": float(np.median(spent)) if spent else float("nan")}


def engine_rejections(engine, reranker, test_items, test_pairs, args, suffix, judged: bool = False) -> dict:
    """Answers the first args.engine_answers test questions that have an off-topic version both ways, as a user's
    call does (engine.answer(certify=True): the trusted candidates, or "unknown" without an LLM call when none is
    trusted), cached in benchmarks/data by question and way; the share rejected each way, split by cause. judged:
    with judge_support=True (the shipped answer-presence rule decides support; cached apart)."""
    import time

    import numpy as np
    from tqdm.auto import tqdm

    from certrag.eval.metrics import answer_in_text

    key = {"reader": engine.llm.name, "reranker": reranker.name, "store": len(engine),
           "selection": repr(engine.config.selection), "threshold": engine.calibration.s_thres}
    rule = engine.presence_rule if judged else None
    if judged:
        if rule is None:
            raise SystemExit(f"--judge-support: no answer-presence rule ships with {reranker.name}")
        key["presence_rule"] = {"judge": rule.judge, "threshold": rule.threshold}
    cache_path, cache = keyed_cache(f"abstention_engine_answers{suffix}{'-judged' if rule else ''}.json", key,
                                    "answers")

    def answered(question, r, way):
        k = f"{way}\t{question}"
        if k not in cache["answers"]:
            t0 = time.perf_counter()
            a = engine.answer(question, retrieval=r, certify=True, judge_support=rule is not None)
            cache["answers"][k] = {"text": a.text, "rejected": a.rejected, "llm_calls": a.trace.get("llm_calls", 0),
                                   "seconds": time.perf_counter() - t0, "supported": a.support["supported"]}
            if len(cache["answers"]) % 40 == 0:
                save_cache(cache_path, cache)
        return cache["answers"][k]

    chosen = both_versions(test_items, test_pairs)
    out, spent = {"answerable": [], "off-topic": []}, []
    for it, r, w in tqdm(chosen[: args.engine_answers], desc="engine answers"):
        for way, ret in (("answerable", r), ("off-topic", w)):
            a = answered(it.question, ret, way)
            out[way].append((a["rejected"], a["llm_calls"] == 0, answer_in_text(a["text"], it.answers),
                             None if "supported" not in a else not a["supported"]))
            if a["llm_calls"]:
                spent.append(a["seconds"])
    save_cache(cache_path, cache)
    summary = {"questions": len(out["answerable"]), "reader": engine.llm.name, "judged": rule is not None,
               "seconds_per_answer": float(np.median(spent)) if spent else float("nan")}
    for way, rows in out.items():
        rej = np.array([x[0] for x in rows])
        by_retrieval = np.array([x[0] and x[1] for x in rows])
        summary[way] = {"rejected": float(rej.mean()), "ci": list(_common.bootstrap(rej.astype(float))),
                        "by_retrieval": float(by_retrieval.mean()),
                        "by_reader": float((rej & ~by_retrieval).mean()),
                        "correct": float(np.mean([x[2] and not x[0] for x in rows])),
                        "flagged": (None if any(x[3] is None for x in rows)  # answers cached before it was kept
                                    else float(np.mean([x[3] for x in rows])))}
    return summary


STRICT_OPTION = "Answer only from the passages. If the passages do not give the answer, reply: unknown"


def unknown_flag(engine, reranker, train, test_items, test_pairs, args, suffix) -> dict:
    """The reader's P(first answer token is "unknown") after the plain prompt over the default selection's passages
    (or the passages-only prompt), for the first TRAIN / TEST questions with an off-topic version, both ways (cached
    in benchmarks/data by question, way, prompt and reader); flags adding it to the best score, fitted on train."""
    import numpy as np
    from tqdm.auto import tqdm

    from certrag.certify import presence
    from certrag.llm import prompts
    from certrag.select import cut
    from certrag.train.factuality import auroc

    n_train, n_test = args.unknown_probe
    llm, selector = engine.llm, engine.config.selection.make()
    ids = presence.first_token_ids(llm.tokenizer, ("unknown", "Unknown", " unknown", "UNKNOWN"))
    cache_path, cache = keyed_cache(f"abstention_unknown_probe{suffix}.json",
                                    {"reader": llm.name, "reranker": reranker.name, "store": len(engine),
                                     "token_ids": ids, "selection": repr(engine.config.selection)}, "probes")

    def prompt(question, r):
        n = cut(selector, r.rerank_scores, "logit")
        messages = prompts.plain_messages(question, [prompts.Passage(text=r.texts[i], chunk_id=int(r.chunk_ids[i]))
                                                     for i in range(n)])
        if args.probe_prompt == "strict":
            messages[-1]["content"] = messages[-1]["content"].replace(prompts.UNKNOWN_OPTION, STRICT_OPTION)
        return llm.prompt_ids(messages)

    def rows(items, pairs, n, desc):
        chosen = both_versions(items, pairs)[:n]
        todo = [(f"{args.probe_prompt}\t{way}\t{it.question}", it.question, ret) for it, r, w in chosen
                for way, ret in (("on", r), ("off", w))]
        todo = [t for t in todo if t[0] not in cache["probes"]]
        for i in tqdm(range(0, len(todo), 16), desc=desc):
            batch = todo[i: i + 16]
            p = llm.next_token_probs([prompt(q, ret) for _, q, ret in batch], ids).sum(1)
            cache["probes"].update({k: float(v) for (k, _, _), v in zip(batch, p)})
            save_cache(cache_path, cache)

        def x(question, r, way):
            return [float(np.max(r.rerank_scores)),
                    float(np.log(max(cache["probes"][f"{args.probe_prompt}\t{way}\t{question}"], 1e-9)))]
        return (np.array([x(it.question, r, "on") for it, r, _ in chosen]),
                np.array([x(it.question, w, "off") for it, _, w in chosen]))

    tr_on, tr_off = rows(*train, n_train, "train probes")
    te_on, te_off = rows(test_items, test_pairs, n_test, "test probes")
    flags = fitted_flags("best fused score + reader's log P(unknown), logistic regression", (tr_on, tr_off),
                         (te_on, te_off))
    y = np.r_[np.ones(len(te_on)), np.zeros(len(te_off))]
    c = or_rule_threshold(engine.calibration.s_thres, tr_on[:, 0], tr_on[:, 1])
    flags.append(or_rule(f"calibrated retrieval flag or P(unknown) > {np.exp(c):.3f}", c, engine.calibration.s_thres,
                         (te_on[:, 0], te_on[:, 1]), (te_off[:, 0], te_off[:, 1]), c))
    return {"reader": llm.name, "prompt": args.probe_prompt, "train_questions": len(tr_on),
            "auroc_alone": auroc(y, -np.r_[te_on[:, 1], te_off[:, 1]]),
            "test_questions": len(te_on), "flags": flags}


def presence_flag(engine, reranker, test_items, test_pairs, args, judge) -> dict:
    """A reader's log-odds that the best candidate states the answer ('yes' against 'no' as its first token; one
    prefill of the passage and the question), for the first CAL / TEST calibration and test questions with an
    off-topic version, both ways (cached in benchmarks/data by split, way, question and reader); flags adding it to
    the best score, fitted on the calibration split."""
    import time

    import numpy as np
    from tqdm.auto import tqdm

    from certrag.certify import presence
    from certrag.certify.calibration import load_calibration_items
    from certrag.llm.local import LocalLLM
    from certrag.train.factuality import auroc

    from _nq import cached_retrievals

    n_cal, n_test = args.presence_judge
    cal_items = load_calibration_items("nq-open:calibration")
    cal_results = cached_retrievals(engine, reranker, [it.question for it in cal_items], args.candidates,
                                    "calibration_candidates.json")
    cal_pairs = [both_ways_of(judge, it, r) for it, r in zip(cal_items, cal_results)]
    cache_path, cache = keyed_cache(f"abstention_presence_judge-{args.judge_model}.json",
                                    {"reader": args.judge_model, "weights": "q8", "reranker": reranker.name,
                                     "store": len(engine), "question": presence.QUESTION}, "judgments")
    llm, seconds = None, []  # the judge is loaded on first need

    def log_odds(question, r) -> float:
        """The judgment judge_support makes (certrag.certify.presence.log_odds), timed."""
        nonlocal llm
        if llm is None:
            llm = LocalLLM(args.judge_model, weights="q8", num_threads=1)
        t0 = time.perf_counter()
        said = float(presence.log_odds(llm, [(question, r.texts[int(np.argmax(r.rerank_scores))])])[0])
        seconds.append(time.perf_counter() - t0)
        return said

    def rows(split, items, pairs, n):
        chosen = both_versions(items, pairs)[:n]
        todo = [(f"{split}\t{way}\t{it.question}", it.question, ret) for it, r, w in chosen
                for way, ret in (("on", r), ("off", w))]
        for k, q, ret in tqdm([t for t in todo if t[0] not in cache["judgments"]], desc=f"{split} judgments"):
            cache["judgments"][k] = log_odds(q, ret)
            save_cache(cache_path, cache)

        def x(question, r, way):
            return [float(np.max(r.rerank_scores)), cache["judgments"][f"{split}\t{way}\t{question}"]]
        return (np.array([x(it.question, r, "on") for it, r, _ in chosen]),
                np.array([x(it.question, w, "off") for it, _, w in chosen]))

    cal_on, cal_off = rows("calibration", cal_items, cal_pairs, n_cal)
    te_on, te_off = rows("test", test_items, test_pairs, n_test)
    flags = fitted_flags("best fused score + the reader's log-odds that the passage states the answer, logistic "
                         "regression", (cal_on, cal_off), (te_on, te_off))
    s_thres = engine.calibration.s_thres
    c = -or_rule_threshold(s_thres, cal_on[:, 0], -cal_on[:, 1])
    flags.append(or_rule(f"calibrated retrieval flag or log-odds below {c:.2f}", c, s_thres,
                         (te_on[:, 0], -te_on[:, 1]), (te_off[:, 0], -te_off[:, 1]), -c))
    y = np.r_[np.ones(len(te_on)), np.zeros(len(te_off))]
    rule = engine.presence_rule
    if rule is not None and rule.judge == args.judge_model:  # what judge_support runs, fitted by the package
        v_on, v_off = (np.array([rule.value(*x) for x in rows]) for rows in (te_on, te_off))
        fitted = rule.fit.get("measured_on_fit_rows", {}).get("answerable")
        flags.append({"flag": f"the shipped rule, `judge_support=True` (fitted on {fitted} calibration questions)",
                      "train_threshold": rule.threshold, "answerable_flagged": float(np.mean(v_on < rule.threshold)),
                      "offtopic_flagged": float(np.mean(v_off < rule.threshold)), "auroc": auroc(y, np.r_[v_on, v_off])})
    return {"reader": args.judge_model, "calibration_questions": len(cal_on), "test_questions": len(te_on),
            "auroc_alone": auroc(y, np.r_[te_on[:, 1], te_off[:, 1]]), "flags": flags,
            "seconds_per_judgment": float(np.median(seconds)) if seconds else float("nan"), "judged_now": len(seconds)}


if __name__ == "__main__":
    main()
