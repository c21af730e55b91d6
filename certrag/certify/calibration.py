"""Making a conformal calibration: calibration items, the judge that marks candidates correct, scoring items through
the engine's retrieval, the split-conformal threshold and its held-out check, and the coverage sweep with its plot.
The statistics and the stored record are in certrag.certify.conformal."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from certrag.certify.conformal import (Calibration, CalibrationError, ScoredItems, check_alpha, calibrated_scores,
                                       diagnose, items_for_coverage, min_calibration_size, score_transform_name,
                                       threshold)
from certrag.data.splits import normalise_question, stable_fraction


# ------------------------------------------------------------------------------------------- calibration data

@dataclass(frozen=True, kw_only=True)
class CalibrationItem:
    """question; answers: reference answers; source_id: the id of the document that holds the answer (as the store
    names it); source_text: the source passage's text. An item needs answers or a source: a question with only the
    id of the document that answers it is enough (its candidates from that document count as correct)."""

    question: str
    answers: tuple[str, ...]
    source_id: str | None = None
    source_text: str | None = None


def load_calibration_items(data: object) -> list[CalibrationItem]:
    """A JSONL path (one object per line: question, answers (list) or answer (string), and/or source_id (the
    answering document's id in the store) and source (its text); answers may be left out when a source is given),
    the literal 'nq-open:calibration' (the bundled NQ-open calibration split, with its gold passages), or a list of
    CalibrationItem / dicts of the same fields."""
    if isinstance(data, str) and data.startswith("nq-open:"):
        from certrag.data.nq import SPLITS, load_nq_open

        split = data.split(":", 1)[1]
        if split not in SPLITS:
            raise ValueError(f"data: unknown NQ-open split {split!r}; one of {SPLITS}")
        return [CalibrationItem(question=it.question, answers=tuple(it.answers), source_text=it.gold_text)
                for it in load_nq_open(split=split)]
    if isinstance(data, (str, Path)):
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"data: no such file: {path}")
        rows = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path}:{line_no}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise CalibrationError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
    elif isinstance(data, Iterable):
        rows = [(f"item {i}", row) for i, row in enumerate(data)]
    else:
        raise TypeError(f"data must be a JSONL path or a list of items; got {type(data).__name__}")
    items = []
    for where, row in rows:
        if isinstance(row, CalibrationItem):
            items.append(row)
            continue
        if not isinstance(row, dict):
            raise CalibrationError(f"{where}: each item must be an object")
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise CalibrationError(f"{where}: missing field 'question' (a non-empty string)")
        answers = row.get("answers", row.get("answer"))
        source_id, source = row.get("source_id"), row.get("source")
        if isinstance(answers, str):
            answers = [answers]
        if answers is None and (source_id is not None or source is not None):
            answers = []  # unlabelled: the question and the document (or passage) that answers it
        if (not isinstance(answers, list) or (not answers and source_id is None and source is None)
                or not all(isinstance(a, str) and a.strip() for a in answers)):
            raise CalibrationError(f"{where}: needs 'answers' (a list of non-empty strings) or 'answer', or the "
                                   "'source_id' of the document that answers the question")
        if source_id is not None and not isinstance(source_id, (str, int)):
            raise CalibrationError(f"{where}: 'source_id' must be a string")
        if source is not None and not isinstance(source, str):
            raise CalibrationError(f"{where}: 'source' must be a string")
        items.append(CalibrationItem(question=question, answers=tuple(answers),
                                     source_id=None if source_id is None else str(source_id), source_text=source))
    if not items:
        raise CalibrationError("data: the calibration set is empty")
    return items


JUDGE_RULES = ("source_id", "source_text", "answer_span", "answer_rougeL")


def without_correct(judge: "ChunkJudge", item: CalibrationItem, r):
    """The retrieval r (certrag.retrieval.Retrieval) with every candidate the judge marks correct for item removed:
    what a store without any passage that answers the question returns at the top (its best remaining candidates are
    the same whatever would fill the gap below them). None when nothing would remain."""
    import dataclasses

    keep = ~judge.correct(item, r.doc_ids, r.texts)
    if not keep.any():
        return None
    return dataclasses.replace(r, chunk_ids=r.chunk_ids[keep], doc_ids=tuple(np.array(r.doc_ids)[keep]),
                               texts=tuple(np.array(r.texts, dtype=object)[keep]),
                               dense_scores=r.dense_scores[keep], rerank_scores=r.rerank_scores[keep],
                               selected=int(keep.sum()))


class ChunkJudge:
    """Decides which candidates are correct for an item, by four rules (any one suffices):

    - source_id: the candidate's document is the item's source document;
    - source_text: the candidate is a piece of the source passage (RougeL precision >= source_threshold);
    - answer_span: a short reference answer (at most span_tokens tokens) occurs in the candidate as a whole,
      contiguous token span -- for a one- or two-token answer (a year, a number, a name) RougeL recall >= 0.8 is
      merely "the tokens occur somewhere", which marks any chunk mentioning 1990 correct for every 1990 answer;
    - answer_rougeL: a longer answer's RougeL recall >= answer_threshold.
    Tokens are rouge-score's (lower-cased alphanumerics), the implementation the ROUGE-reporting papers use."""

    def __init__(self, *, answer_threshold: float = 0.8, source_threshold: float = 0.9, span_tokens: int = 4) -> None:
        for name, v in (("answer_threshold", answer_threshold), ("source_threshold", source_threshold)):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]; got {v}")
        if isinstance(span_tokens, bool) or not isinstance(span_tokens, int) or span_tokens < 0:
            raise ValueError(f"span_tokens must be a non-negative integer; got {span_tokens!r}")
        from rouge_score import rouge_scorer, tokenizers

        self.answer_threshold = answer_threshold
        self.source_threshold = source_threshold
        self.span_tokens = span_tokens
        self._scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        self._tokenize = tokenizers.DefaultTokenizer(use_stemmer=False).tokenize

    def correct(self, item: CalibrationItem, doc_ids: Sequence[str], texts: Sequence[str]) -> np.ndarray:
        """Whether each candidate is correct by any rule."""
        return np.logical_or.reduce(list(self.by_rule(item, doc_ids, texts).values()))

    def by_rule(self, item: CalibrationItem, doc_ids: Sequence[str], texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Each rule's verdict on each candidate (JUDGE_RULES order)."""
        out = {rule: np.zeros(len(texts), dtype=bool) for rule in JUDGE_RULES}
        source_tokens = set(self._tokenize(item.source_text)) if item.source_text else None
        answers = [(a, self._tokenize(a)) for a in item.answers]
        short = [toks for _, toks in answers if toks and len(toks) <= self.span_tokens]
        long = [a for a, toks in answers if len(toks) > self.span_tokens]
        for i, (doc_id, text) in enumerate(zip(doc_ids, texts)):
            out["source_id"][i] = item.source_id is not None and doc_id == item.source_id
            out["source_text"][i] = (source_tokens is not None
                                     and self._is_piece_of_source(text, item.source_text, source_tokens))
            tokens = self._tokenize(text) if short else ()
            out["answer_span"][i] = any(_has_span(tokens, s) for s in short)
            out["answer_rougeL"][i] = any(self._scorer.score(a, text)["rougeL"].recall >= self.answer_threshold
                                          for a in long)
        return out

    def _is_piece_of_source(self, text: str, source: str, source_tokens: set) -> bool:
        tokens = self._tokenize(text)
        if not tokens:
            return False
        # LCS precision <= the fraction of the chunk's tokens found in the source at all: a cheap exact bound that
        # skips the quadratic LCS for unrelated chunks.
        if sum(t in source_tokens for t in tokens) < self.source_threshold * len(tokens):
            return False
        return self._scorer.score(source, text)["rougeL"].precision >= self.source_threshold


def _has_span(tokens: Sequence[str], span: Sequence[str]) -> bool:
    n = len(span)
    return any(list(tokens[i:i + n]) == list(span) for i in range(len(tokens) - n + 1))


def stable_holdout(question: str, fraction: float) -> bool:
    """Whether an item is held out to check coverage: by a stable hash of its normalised question."""
    return stable_fraction("holdout:" + normalise_question(question)) < fraction


def score_items(engine, items: list[CalibrationItem], judge: ChunkJudge, *, candidates: int, transform: str,
                batch: int = 32, progress: bool = True) -> ScoredItems:
    from tqdm.auto import tqdm

    from certrag.select import TopKSelector

    out = ScoredItems()
    keep_all = TopKSelector(k=candidates)
    # counted in questions (a bar per batch hid a 40 s run of fewer than 33 questions)
    with tqdm(total=len(items), desc="calibrating", unit="q", disable=not progress or len(items) < 2) as bar:
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]
            for item, r in zip(chunk, engine.retrieve_batch([it.question for it in chunk], candidates=candidates,
                                                      selector=keep_all)):
                out.scores.append(calibrated_scores(r.rerank_scores, r.dense_scores, transform))
                out.correct.append(judge.correct(item, r.doc_ids, r.texts))
                bar.update(1)
    return out


def calibrate(engine, data: object, *, alpha: float = 0.1, holdout: float = 0.3, eval_data: object = None,
              answer_threshold: float = 0.8, source_threshold: float = 0.9, span_tokens: int = 4,
              candidates: int | None = None, progress: bool = True) -> tuple[Calibration, ScoredItems, ScoredItems]:
    """Calibrates s_thres on data and checks it on held-out items: eval_data when given, else the `holdout`
    fraction of data chosen by a stable hash of the question. Returns the record and the scored calibration and
    held-out items (for sweeps and plots); Engine.calibrate stores the record with the store."""
    check_alpha(alpha)
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1); got {holdout}")
    items = load_calibration_items(data)
    if eval_data is not None:
        cal_items, eval_items = items, load_calibration_items(eval_data)
    else:
        cal_items = [it for it in items if not stable_holdout(it.question, holdout)]
        eval_items = [it for it in items if stable_holdout(it.question, holdout)]
    need = min_calibration_size(alpha)
    if len(cal_items) < need:
        raise CalibrationError(f"alpha={alpha} needs at least {need} calibration items; got {len(cal_items)}"
                               + (f" after holding out {len(eval_items)} for the check" if eval_data is None else "")
                               + f" (and about {items_for_coverage(alpha)} for the coverage it delivers to be within "
                               "0.02 of 1 - alpha with probability 0.9)")
    n_cand = candidates or engine.config.retrieval.candidates
    transform = score_transform_name(engine.reranker_identity() is not None)
    judge = ChunkJudge(answer_threshold=answer_threshold, source_threshold=source_threshold, span_tokens=span_tokens)
    cal = score_items(engine, cal_items, judge, candidates=n_cand, transform=transform, progress=progress)
    held = score_items(engine, eval_items, judge, candidates=n_cand, transform=transform, progress=progress)
    best = cal.best_correct()
    s_thres = threshold(best, alpha)
    record = Calibration(alpha=float(alpha), s_thres=s_thres, n=len(cal_items), score_transform=transform,
                         embedder=engine.embedder_name, reranker=engine.reranker_identity(), candidates=n_cand,
                         answer_threshold=answer_threshold, source_threshold=source_threshold, span_tokens=span_tokens,
                         created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         diagnostics=diagnose(held, s_thres, alpha), chunks=len(engine),
                         n_without_correct=int(np.isinf(best).sum()), reranker_backend=engine.reranker_backend())
    return record, cal, held


def coverage_sweep(cal: ScoredItems, held: ScoredItems, alphas: Sequence[float]) -> list[dict]:
    """For each alpha: the threshold from cal and the diagnostics on held (the calibration plot's points)."""
    rows = []
    best = cal.best_correct()
    for a in alphas:
        if int(np.isfinite(best).sum()) < min_calibration_size(a):
            continue
        s = threshold(best, a)
        d = diagnose(held, s, a)
        rows.append({"alpha": a, "target": 1 - a, "s_thres": s, "coverage": d.coverage,
                     "conditional_coverage": d.conditional_coverage, "m1": d.m1, "m2": d.m2,
                     "mean_trusted": d.mean_trusted, "holds": d.holds})
    return rows


def plot_sweep(rows: list[dict], path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the calibration plot needs matplotlib: pip install matplotlib") from None
    if not rows:
        raise ValueError("no sweep points to plot: the calibration set is too small for every alpha of the sweep")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="coverage = 1 - alpha")
    ax.plot([r["target"] for r in rows], [r["coverage"] for r in rows], "o-", label="empirical coverage")
    ax.plot([r["target"] for r in rows], [r["m1"] for r in rows], "s:", label="m1")
    lo = min(r["target"] for r in rows)
    ax.set_xlim(lo - 0.02, 1.0)
    ax.set_ylim(min(lo, min(r["coverage"] for r in rows)) - 0.02, 1.0)
    ax.set_xlabel("1 - alpha")
    ax.set_ylabel("held-out rate")
    ax.set_title(title or "conformal retrieval: coverage against target")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import io

    from certrag.atomic import write_file_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_file_atomic(path, buffer.getvalue())
    return path
