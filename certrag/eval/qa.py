"""The QA evaluation harness: EM / F1 (DPR normalisation), reject rate, tokens, cost and cost-efficiency, over the
engine's own retrieval or over Chain-of-Note's noise protocol (Yu et al., 2023, section 4 and Table 3).

Noise protocol for k passages and noise ratio r, as the paper runs it: exactly k passages, of which
noisy = floor(k r + 1/2) are irrelevant (k r rounded half up: k = 5, r = 0.5 is 2 relevant + 3 noisy) and
k - noisy relevant. Relevant passages are *retrieved* ones that hold a gold answer string (from the question's top
100 by the bi-encoder, best first; the gold passage counts only when retrieval finds it -- nothing is injected).
Noisy ones are, for noise="hard", the highest-reranked candidates that hold no answer string (the paper's "noisy
retrieved documents"); for noise="random", Wikipedia leads of the bundled corpus drawn with a seed fixed per
question (the paper's random-noise variant). One question set serves every ratio: a question qualifies when it has
k relevant and k noisy passages (the needs of r = 0 and r = 1), so the ratios differ in noise alone; evaluate()
reports how many qualified. Passage order is shuffled with a seed fixed per question.

Unanswerable questions (noise_ratio="unanswerable"): the question answered from its top k answer-free candidates --
the store without any passage that answers it, as if the gold passage had been removed; every question qualifies.
The reject rate there is the honest "unknown" the paper measures.
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


NOISE_KINDS = ("hard", "random")


def _answer_bearing(pool, answers, n: int) -> list:
    from certrag.llm.prompts import Passage

    out, seen = [], set()
    for cid, text in zip(pool.chunk_ids, pool.texts):
        if len(out) >= n:
            break
        if text.strip() not in seen and answer_in_text(text, answers):
            out.append(Passage(text, chunk_id=int(cid)))
            seen.add(text.strip())
    return out


def _answer_free(item: QAItem, retrieval, n: int, noise: str, leads: list[str] | None) -> list:
    from certrag.llm.prompts import Passage

    if noise == "random":
        if not leads:
            raise ValueError("random noise needs the corpus of leads to draw from (leads=...)")
        rng = random.Random(stable_seed("random-noise:" + item.question))
        out, seen = [], set()
        while len(out) < n and len(seen) < len(leads):
            i = rng.randrange(len(leads))
            if i not in seen and not answer_in_text(leads[i], item.answers):
                out.append(Passage(leads[i], chunk_id=-1))
            seen.add(i)
        return out
    out, seen = [], set()
    for cid, text in zip(retrieval.chunk_ids, retrieval.texts):
        if len(out) >= n:
            break
        if text.strip() not in seen and not answer_in_text(text, item.answers):
            out.append(Passage(text, chunk_id=int(cid)))
            seen.add(text.strip())
    return out


def noise_passages(item: QAItem, retrieval, k: int, ratio: float, relevant_pool=None, *, noise: str = "hard",
                   leads: list[str] | None = None) -> tuple[list, int, int] | None:
    """(passages, relevant count, noisy count) for the noise protocol, or None when the question does not qualify:
    fewer than k retrieved answer-bearing passages in relevant_pool (a Retrieval; default: retrieval) or fewer than
    k noisy ones -- the needs of r = 0 and r = 1, so every ratio runs on the same questions."""
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {NOISE_KINDS}; got {noise!r}")
    want_relevant, want_noisy = noise_split(k, ratio)
    relevant = _answer_bearing(relevant_pool if relevant_pool is not None else retrieval, item.answers, k)
    noisy = _answer_free(item, retrieval, k, noise, leads)
    if len(relevant) < k or len(noisy) < k:
        return None
    passages = relevant[:want_relevant] + noisy[:want_noisy]
    random.Random(stable_seed(item.question)).shuffle(passages)
    return passages, want_relevant, want_noisy


def unanswerable_passages(item: QAItem, retrieval, k: int) -> list | None:
    """The question's top k answer-free candidates (the store with every passage that answers it removed), or
    None when it has fewer."""
    noisy = _answer_free(item, retrieval, k, "hard", None)
    return noisy if len(noisy) == k else None


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


def evaluate(engine, items: list[QAItem], strategy: str = "plain", *, noise_ratio: float | str | None = None,
             k: int = 5, noise: str = "hard", leads: list[str] | None = None, prices: PriceTable | None = None,
             max_new_tokens: int | None = None, progress: bool = True, retrievals: dict | None = None) -> dict:
    """Runs every item and returns {"rows": [...], "summary": {...}}. noise_ratio None: the engine's own retrieval
    and selection; a number in [0, 1]: the noise protocol (noise "hard" or "random"; the items that do not qualify
    are skipped and counted, summary["skipped"]); "unanswerable": the top k answer-free candidates. retrievals: a
    dict the protocol keeps its retrievals in, by question, so several ratios over the same questions retrieve
    once."""
    from tqdm.auto import tqdm

    from certrag.strategies import make_strategy

    prices = prices or PriceTable()
    if noise_ratio is not None and noise_ratio != "unanswerable":
        noise_split(k, float(noise_ratio))  # checks both
    rows, skipped = [], 0
    for item in tqdm(items, desc=f"{strategy} noise={noise_ratio}", disable=not progress):
        started = time.perf_counter()
        if noise_ratio is None:
            a = engine.answer(item.question, strategy=strategy, prices=prices, max_new_tokens=max_new_tokens)
            pred, rejected, malformed = a.text, a.rejected, a.malformed
            tin, tout, cost, rounds, rel, noisy = a.input_tokens, a.output_tokens, a.cost, a.rounds, -1, -1
            history = tuple(a.trace.get("history", ()))
        else:
            if strategy.startswith("feedback"):
                raise ValueError(f"the noise protocol runs plain, chain_of_note or self_rag, not {strategy!r}")
            ranked, pool = protocol_retrievals(engine, item.question, k, retrievals)
            if noise_ratio == "unanswerable":
                passages = unanswerable_passages(item, ranked, k)
                chosen = None if passages is None else (passages, 0, k)
            else:
                chosen = noise_passages(item, ranked, k, float(noise_ratio), relevant_pool=pool, noise=noise,
                                        leads=leads)
            if chosen is None:  # does not qualify
                skipped += 1
                continue
            passages, rel, noisy = chosen
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
                          malformed=malformed, relevant_passages=rel, noisy_passages=noisy, input_tokens=tin,
                          output_tokens=tout, cost=cost, seconds=time.perf_counter() - started, rounds=rounds,
                          history=history))
    summary = {**summarise(rows, strategy, noise_ratio), "skipped": skipped, "noise": noise if noise_ratio not in
               (None, "unanswerable") else None}
    return {"rows": [asdict(r) for r in rows], "summary": summary}


def summarise(rows: list[QARow], strategy: str, noise_ratio: float | str | None) -> dict:
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
        ratio = s["noise_ratio"]
        noise = ("retrieved" if ratio is None else ratio if isinstance(ratio, str)
                 else f"{ratio:.1f}" + (" random" if s.get("noise") == "random" else ""))
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
