"""Answering, once retrieval has run: the options of one answer, the Answer it returns, and the orchestration that
certifies the context, runs the strategy, reads the answer's P(correct) and bills the tokens.

Everything a request asks for travels in one frozen AnswerOptions and in the arguments of answer(): nothing is set
on the LLM, the strategy or the engine, so concurrent answers share no mutable state.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from certrag.certify.factuality import answer_signals
from certrag.config import SelectionConfig
from certrag.cost import PriceTable
from certrag.grounding import grounded_run
from certrag.llm.prompts import QUESTION_TYPES, Passage
from certrag.retrieval import Retrieval
from certrag.select import cut
from certrag.strategies import UNKNOWN, Selection, Strategy


@dataclass(frozen=True, kw_only=True)
class AnswerOptions:
    """What one answer asks for besides the question and the strategy.

    qtype: open | multiple_choice (with options) | yes_no. prices: a certrag.cost.PriceTable (default: the
    placeholder table). max_new_tokens: overrides the strategy's answer budget (Chain-of-Note: per note; Self-RAG:
    per segment). certify: send only the candidates trusted under the store's conformal calibration, when its
    diagnostics say the guarantee holds; force_certify: even when they do not. confidence: fill Answer.p_correct,
    the probability that the answer contains a reference answer, from the classifier shipped for the local model
    (certrag.certify.factuality: lookback ratios recorded while it writes, stacked with the answer's mean token
    log-probability, or the calibrated log-probability alone -- the card says which and why). grounding: check
    that an open answer rests on sentences relevant to the question, answering again without the off-topic ones
    when it does not (certrag.grounding: the injection defence that reads no list of phrasings). history: the
    conversation before the question, (role, text) pairs, shown to the model with the question (retrieval reads
    the question alone). judge_support: Answer.support also asks a reader whether the best candidate states the
    answer and lets the answer-presence rule shipped with the reranker decide (certrag.certify.presence; one
    prefill of the rule's model, qwen2.5-coder-1.5b-instruct, about 2 s on one core); with certify, a question it
    judges not supported is answered "unknown" without an LLM call."""

    qtype: str = "open"
    options: tuple[str, ...] | None = None
    prices: PriceTable | None = None
    max_new_tokens: int | None = None
    certify: bool = False
    force_certify: bool = False
    confidence: bool = False
    grounding: bool = True
    history: tuple[tuple[str, str], ...] = ()
    judge_support: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in QUESTION_TYPES:
            raise ValueError(f"qtype must be one of {', '.join(QUESTION_TYPES)}; got {self.qtype!r}")
        if self.options is not None:
            if isinstance(self.options, str) or not all(isinstance(o, str) for o in self.options):
                raise ValueError("options must be a list of strings")
            object.__setattr__(self, "options", tuple(self.options))
        if self.max_new_tokens is not None and (isinstance(self.max_new_tokens, bool)
                                                or not isinstance(self.max_new_tokens, int)
                                                or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive integer; got {self.max_new_tokens!r}")
        if isinstance(self.history, (str, bytes)) or not all(
                isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t)
                for t in self.history):
            raise ValueError("history must be a list of (role, text) pairs of strings")
        object.__setattr__(self, "history", tuple(tuple(t) for t in self.history))


@dataclass(frozen=True)
class Answer:
    """An answer with its evidence and its bill: the chunks it cites, Chain-of-Note's notes where any, the feedback
    rounds, tokens and cost over every LLM call, and the per-stage trace (milliseconds)."""

    question: str
    text: str
    strategy: str
    cited_chunk_ids: tuple[int, ...]
    notes: tuple = ()
    rejected: bool = False
    malformed: bool = False
    rounds: int = 1
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    model: str = ""
    trace: dict = field(default_factory=dict)
    retrieval: Retrieval | None = None
    certification: object = None  # certrag.certify.conformal.Certification when certify was asked for
    p_correct: float | None = None  # P(the answer contains a reference answer), when confidence was asked for
    lookback: object = None  # certrag.certify.lookback.LookbackFeatures of the answer's generation, when recorded
    grounding: object = None  # certrag.grounding.Grounding of an open answer when it was checked
    finish_reason: str = "stop"  # of the call that wrote the answer: "length" when max tokens cut it
    support: dict | None = None  # Engine.support: did retrieval find anything the calibration trusts

    @property
    def confidence(self) -> float | None:
        """The former name of p_correct (it was documented as P(supported); what it predicts is P(correct))."""
        return self.p_correct

    def to_dict(self) -> dict:
        return {"question": self.question, "answer": self.text, "strategy": self.strategy,
                "certification": self.certification.to_dict() if self.certification is not None else None,
                "p_correct": self.p_correct,
                "grounding": self.grounding.to_dict() if self.grounding is not None else None,
                "cited_chunk_ids": list(self.cited_chunk_ids),
                "notes": [{"passage": n.passage, "kind": n.kind, "claimed": n.claimed or n.kind, "text": n.text}
                          for n in self.notes],
                "rejected": self.rejected, "malformed": self.malformed, "rounds": self.rounds,
                "finish_reason": self.finish_reason, "support": self.support,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens, "cost": self.cost,
                "model": self.model, "trace": self.trace}


def _selection(r: Retrieval, config: SelectionConfig, limit: int) -> Selection:
    """How a strategy may move the cut (SAGE's feedback loop): the gradient rule re-run on the same reranked
    candidates with min_k moved, never past `limit` (the certified set when certification applies)."""
    scores, kind = ((r.rerank_scores, "logit") if not np.isnan(r.rerank_scores).all()
                    else (r.dense_scores, "cosine"))
    gradient = dataclasses.replace(config, method="gradient")

    def passages(min_k: int) -> list[Passage]:
        sel = dataclasses.replace(gradient, min_k=min_k, max_k=max(min_k, gradient.max_k)).make()
        return passages_of(r, min(cut(sel, scores, kind), limit))

    return Selection(passages=passages, min_k=min(config.min_k, limit), max_k=limit or 1)


def with_history(question: str, history: tuple[tuple[str, str], ...]) -> str:
    """The question as the model reads it: after the conversation so far, when there is one."""
    if not history:
        return question
    turns = "\n".join(f"{role}: {text}" for role, text in history)
    return f"(The conversation so far:\n{turns}\n)\n{question}"


def passages_of(r: Retrieval, n: int) -> list[Passage]:
    """The first n candidates of a retrieval as prompt passages."""
    return [Passage(text=r.texts[i], chunk_id=int(r.chunk_ids[i])) for i in range(n)]


def _signals(call, question: str, r: Retrieval, classifier, reranker) -> dict:
    """The answer's free signals (certrag.certify.factuality.answer_signals: the answer call's text and token
    log-probabilities, as at training) over the passages it read; a retrieval the reranker skipped (rerank=False,
    the adaptive rule) has its read passages scored now when the classifier reads their best score, so the
    confidence exists and means what it was trained on."""
    scores = r.rerank_scores[: r.selected]
    if "top_rerank" in classifier.signals and reranker is not None and r.selected and np.isnan(scores).all():
        scores = reranker.score(question, list(r.texts[: r.selected]), r.dense_scores[: r.selected])
    return answer_signals(getattr(call, "token_logprobs", ()), scores, answer=getattr(call, "text", None),
                          passages=list(r.texts[: r.selected]))


def answer(question: str, r: Retrieval, strategy: Strategy, llm, options: AnswerOptions, *,
           selection: SelectionConfig, certification=None, classifier=None, relevance=None,
           retrieve_ms: float = 0.0, reranker=None, abstain: bool = False) -> Answer:
    """Answers from a retrieval: the selector's cut (or, when certification applies, the trusted candidates, at
    most selection.max_k; none trusted -> "unknown" without an LLM call), the strategy, the answer's lookback
    P(correct) (classifier given; reranker scores the passages read when the classifier needs their best reranker
    score and r carries none), the grounding check (relevance given: certrag.grounding.grounded_run), citations,
    cost and trace. abstain: answer "unknown" without an LLM call (the engine's judged support said the store does
    not hold the answer)."""
    limit = len(r.chunk_ids)
    if certification is not None and certification.applied:
        limit = min(certification.trusted_count, selection.max_k)
        r = dataclasses.replace(r, selected=limit)
    if abstain or limit == 0:
        trace = dict(r.trace, retrieve_ms=retrieve_ms, generate_ms=0.0, llm_calls=0, history=[])
        return Answer(question=question, text=UNKNOWN, strategy=strategy.name, cited_chunk_ids=(),
                      rejected=True, model=getattr(llm, "name", ""), trace=trace, retrieval=r,
                      certification=certification)
    t1 = time.perf_counter()
    result, grounding = grounded_run(strategy, with_history(question, options.history), passages_of(r, r.selected),
                                     llm, options.qtype,
                                     list(options.options) if options.options is not None else None,
                                     relevance=relevance if options.grounding else None,
                                     selection=_selection(r, selection, limit),
                                     record_lookback=classifier is not None and classifier.needs_lookback,
                                     checked_question=question)
    t2 = time.perf_counter()
    conf = features = None
    if classifier is not None and result.answer_call is not None and result.calls:
        call = result.calls[result.answer_call]
        features = call.lookback
        if features is not None or not classifier.needs_lookback:
            conf = classifier.predict(features, getattr(call, "mean_logprob", float("nan")),
                                      signals=_signals(call, question, r, classifier, reranker))
    used = result.passages_used
    cited = tuple(int(r.chunk_ids[i]) for i in range(used))
    if result.cited is not None:
        cited = tuple(int(r.chunk_ids[i]) for i in result.cited if 0 <= i < used)
    elif result.notes and not result.malformed:
        useful = {n.passage for n in result.notes if n.kind in ("answers", "context")}
        cited = tuple(int(r.chunk_ids[i - 1]) for i in sorted(useful) if 1 <= i <= used)
    finish = "stop"
    if result.answer_call is not None and result.calls:
        finish = result.calls[result.answer_call].finish_reason or "stop"
    model = getattr(llm, "name", "llm")
    cost = (options.prices or PriceTable()).cost(model, result.input_tokens, result.output_tokens)
    trace = dict(r.trace, retrieve_ms=retrieve_ms, generate_ms=(t2 - t1) * 1e3, llm_calls=len(result.calls),
                 history=list(result.history))
    return Answer(question=question, text=result.text, strategy=strategy.name, cited_chunk_ids=cited,
                  notes=result.notes, rejected=result.rejected, malformed=result.malformed, rounds=result.rounds,
                  input_tokens=result.input_tokens, output_tokens=result.output_tokens, cost=cost, model=model,
                  trace=trace, retrieval=r, certification=certification, p_correct=conf, lookback=features,
                  grounding=grounding, finish_reason=finish)
