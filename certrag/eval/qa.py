"""The QA evaluation harness: EM / F1 (DPR normalisation), reject rate, tokens, cost and cost-efficiency, over the
engine's own retrieval or over Chain-of-Note's noise protocol (Yu et al., 2023, Table 3).

Noise protocol for k passages and noise ratio r (Yu et al., 2023, Table 3): exactly k passages, of which
noisy = floor(k r + 1/2) are irrelevant (k r rounded half up, so an odd split never understates the noise: k = 5,
r = 0.5 is 2 relevant + 3 noisy) and k - noisy relevant. Relevant passages are the gold passage first, then passages
holding a gold answer string from a deep dense pool (the question's top 100 by the bi-encoder); irrelevant ones are
the highest-reranked of the question's candidates that hold no answer string and are not the gold passage (hard
noise). A question without enough of either is not eligible for that ratio: evaluate() skips it and reports how many
it skipped, so every row of a condition has exactly k passages and context length is not confounded with noise.
Passage order is shuffled with a seed fixed per question, so no strategy benefits from the gold coming first.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from certrag.cost import PriceTable, cost_efficiency
from certrag.data.nq import QAItem
from certrag.data.splits import stable_seed
from certrag.eval.metrics import answer_in_text, exact_match, f1_score


@dataclass(frozen=True)
class QARow:
    question: str
    answers: tuple[str, ...]
    prediction: str
    em: float
    f1: float
    rejected: bool
    malformed: bool
    relevant_passages: int
    noisy_passages: int
    input_tokens: int
    output_tokens: int
    cost: float
    seconds: float
    rounds: int = 1
    history: tuple = ()  # the strategy's own record (the feedback loop's rounds with the judge's verdicts, ...)


RELEVANT_POOL = 100  # dense candidates searched for answer-bearing passages


def noise_split(k: int, ratio: float) -> tuple[int, int]:
    """(relevant, noisy) passage counts of the protocol: noisy = floor(k r + 1/2), relevant = k - noisy."""
    import math

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer; got {k!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"noise ratio must be in [0, 1]; got {ratio}")
    noisy = math.floor(k * ratio + 0.5 + 1e-9)
    return k - noisy, noisy


def noise_passages(item: QAItem, retrieval, k: int, ratio: float, relevant_pool=None) -> tuple[list, int, int] | None:
    """(passages, relevant count, noisy count) for the noise protocol, or None when the question has too few
    relevant passages (the gold one plus answer-bearing passages of relevant_pool, a Retrieval; default: retrieval)
    or too few hard negatives (answer-free candidates of retrieval, best first) for the ratio."""
    from certrag.llm.prompts import Passage

    want_relevant, want_noisy = noise_split(k, ratio)
    gold = item.gold_text.strip()
    relevant = [Passage(item.gold_text, chunk_id=-1)] if want_relevant else []
    pool = relevant_pool if relevant_pool is not None else retrieval
    seen = {gold}
    for cid, text in zip(pool.chunk_ids, pool.texts):
        if len(relevant) >= want_relevant:
            break
        if text.strip() not in seen and answer_in_text(text, item.answers):
            relevant.append(Passage(text, chunk_id=int(cid)))
            seen.add(text.strip())
    noisy = []
    for cid, text in zip(retrieval.chunk_ids, retrieval.texts):
        if len(noisy) >= want_noisy:
            break
        if text.strip() not in seen and not answer_in_text(text, item.answers):
            noisy.append(Passage(text, chunk_id=int(cid)))
            seen.add(text.strip())
    if len(relevant) < want_relevant or len(noisy) < want_noisy:
        return None
    passages = relevant + noisy
    random.Random(stable_seed(item.question)).shuffle(passages)
    return passages, len(relevant), len(noisy)


def protocol_retrievals(engine, question: str, k: int, cache: dict | None = None):
    """The two retrievals the noise protocol draws from: the reranked candidates (hard negatives, max(20, 4k)) and
    the deep dense pool (relevant passages), kept in `cache` by question so several ratios retrieve once."""
    from certrag.select import TopKSelector

    key = (question, max(20, 4 * k))
    if cache is not None and key in cache:
        return cache[key]
    ranked = engine.retrieve(question, candidates=key[1])
    pool = engine.retrieve(question, candidates=RELEVANT_POOL, selector=TopKSelector(k=RELEVANT_POOL), rerank=False)
    if cache is not None:
        cache[key] = (ranked, pool)
    return ranked, pool


def evaluate(engine, items: list[QAItem], strategy: str = "plain", *, noise_ratio: float | None = None, k: int = 5,
             prices: PriceTable | None = None, max_new_tokens: int | None = None, progress: bool = True,
             retrievals: dict | None = None) -> dict:
    """Runs every item and returns {"rows": [...], "summary": {...}}; under the noise protocol, items not eligible
    for the ratio are skipped (summary["skipped"]). retrievals: a dict the noise protocol keeps its retrievals in,
    by question, so that several noise ratios over the same questions retrieve once."""
    from tqdm.auto import tqdm

    from certrag.strategies import make_strategy

    prices = prices or PriceTable()
    rows, skipped = [], 0
    for item in tqdm(items, desc=f"{strategy} noise={noise_ratio}", disable=not progress):
        started = time.perf_counter()
        if noise_ratio is None:
            a = engine.answer(item.question, strategy=strategy, prices=prices, max_new_tokens=max_new_tokens)
            pred, rejected, malformed = a.text, a.rejected, a.malformed
            tin, tout, cost, rounds, rel, noise = a.input_tokens, a.output_tokens, a.cost, a.rounds, -1, -1
            history = tuple(a.trace.get("history", ()))
        else:
            if strategy.startswith("feedback"):
                raise ValueError(f"the noise protocol runs plain, chain_of_note or self_rag, not {strategy!r}")
            ranked, pool = protocol_retrievals(engine, item.question, k, retrievals)
            chosen = noise_passages(item, ranked, k, noise_ratio, relevant_pool=pool)
            if chosen is None:  # not eligible for this ratio: too few relevant passages or hard negatives
                skipped += 1
                continue
            passages, rel, noise = chosen
            base = make_strategy(strategy)
            if max_new_tokens is not None:
                base = base.with_max_new_tokens(max_new_tokens)
            res = base.run(item.question, passages, engine.llm)
            pred, rejected, malformed, rounds, history = res.text, res.rejected, res.malformed, 1, res.history
            tin, tout = res.input_tokens, res.output_tokens
            cost = prices.cost(getattr(engine.llm, "name", "llm"), tin, tout)
        rows.append(QARow(question=item.question, answers=item.answers, prediction=pred,
                          em=0.0 if rejected else exact_match(pred, item.answers),
                          f1=0.0 if rejected else f1_score(pred, item.answers), rejected=rejected,
                          malformed=malformed, relevant_passages=rel, noisy_passages=noise, input_tokens=tin,
                          output_tokens=tout, cost=cost, seconds=time.perf_counter() - started, rounds=rounds,
                          history=history))
    summary = {**summarise(rows, strategy, noise_ratio), "skipped": skipped}
    return {"rows": [asdict(r) for r in rows], "summary": summary}


def summarise(rows: list[QARow], strategy: str, noise_ratio: float | None) -> dict:
    if not rows:
        return {"strategy": strategy, "noise_ratio": noise_ratio, "n": 0}
    em = float(np.mean([r.em for r in rows]))
    cost = float(np.mean([r.cost for r in rows]))
    return {"strategy": strategy, "noise_ratio": noise_ratio, "n": len(rows), "em": em,
            "f1": float(np.mean([r.f1 for r in rows])),
            "reject_rate": float(np.mean([r.rejected for r in rows])),
            "malformed_rate": float(np.mean([r.malformed for r in rows])),
            "input_tokens": float(np.mean([r.input_tokens for r in rows])),
            "output_tokens": float(np.mean([r.output_tokens for r in rows])),
            "cost": cost, "cost_efficiency": cost_efficiency(em, cost),
            "latency_p50_s": float(np.median([r.seconds for r in rows])),
            "rounds": float(np.mean([r.rounds for r in rows]))}


def markdown(summaries: list[dict]) -> str:
    head = "| strategy | noise | n | EM | F1 | reject | malformed | in tok | out tok | cost | EM/cost | p50 s |"
    lines = [head, "|" + "---|" * 12]
    for s in summaries:
        noise = "retrieved" if s["noise_ratio"] is None else f"{s['noise_ratio']:.1f}"
        if not s["n"]:
            lines.append(f"| {s['strategy']} | {noise} | 0 |" + " n/a |" * 9)
            continue
        lines.append(f"| {s['strategy']} | {noise} | {s['n']} | {s['em']:.3f} | {s['f1']:.3f} | "
                     f"{s['reject_rate']:.3f} | {s['malformed_rate']:.3f} | {s['input_tokens']:.0f} | "
                     f"{s['output_tokens']:.0f} | {s['cost']:.2e} | {s['cost_efficiency']:.3g} | "
                     f"{s['latency_p50_s']:.1f} |")
    return "\n".join(lines)


def write_report(path: str | Path, reports: list[dict]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(reports, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
