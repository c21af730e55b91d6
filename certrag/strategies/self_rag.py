"""Self-RAG (Asai et al., 2024): reflection scores from next-token probabilities, adaptive retrieval, and
segment-level beam search -- computed on probabilities, with scores combined so that no ranking inverts.

Reflection groups and scores (DESIGN.md), from the full next-token distribution of one forward pass:
    s(IsRel) = p(Relevant) / (p(Relevant) + p(Irrelevant))
    s(IsSup) = (p(Fully) + 0.5 p(Partially)) / (p(Fully) + p(Partially) + p(No support))
    s(IsUse) = sum_i w_i p(Utility=i) / sum_j p(Utility=j),  w = [-1, -0.5, 0, 0.5, 1]
    retrieve when p(Yes) / (p(Yes) + p(No)) > delta
A group whose probabilities are missing or sum to zero has no score: it adds nothing to a segment's score (and the
retrieval decision defaults to retrieving). The reference implementation divides raw log-probabilities and
multiplies scores that can be negative; here every score is a ratio of probabilities.

A model whose vocabulary holds Self-RAG's reflection tokens ([Retrieval], [Relevant], [Fully supported],
[Utility:5], ...) is read directly, in Self-RAG's own prompt layout. Any other causal LM gets one short critique
prompt per group, and the group's probabilities are those of its label words' first tokens.

Segment score: (p(segment) + w_rel s(IsRel) + w_sup s(IsSup) + w_use s(IsUse)) / (1 + the absolute weights of the
groups present), with p(segment) the geometric mean of the probabilities of the tokens the segment keeps (its first
sentence when the path may continue; the whole generation when max_depth is 1). Dividing by the weights present, as
the reference code normalises its critique by what it read, puts a segment written without retrieval (IsUse only) on
the same scale as one with all three groups: unnormalised, it would lose up to w_rel + w_sup points in the same beam
for lacking terms, not for being worse. A path's score is the *mean* of its segments' scores: additive, so a path
whose every segment scores at least another's never ranks below it, whatever the signs (a product, as in the
reference code, inverts rankings once a term is negative), and a mean, so paths of different depths compare fairly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from certrag.llm.local import Generation
from certrag.llm.prompts import Passage, escape, plain_messages
from certrag.strategies.base import (LLM, UNKNOWN, Selection, StrategyResult, first_line, generate_all,
                                     is_unknown)

UTILITY_WEIGHTS = (-1.0, -0.5, 0.0, 0.5, 1.0)
GROUPS = {
    "retrieve": ("yes", "no", "continue"),
    "isrel": ("relevant", "irrelevant"),
    "issup": ("fully", "partially", "no"),
    "isuse": ("1", "2", "3", "4", "5"),
}
REFLECTION_TOKENS = {
    "retrieve": ("[Retrieval]", "[No Retrieval]", "[Continue to Use Evidence]"),
    "isrel": ("[Relevant]", "[Irrelevant]"),
    "issup": ("[Fully supported]", "[Partially supported]", "[No support / Contradictory]"),
    "isuse": tuple(f"[Utility:{i}]" for i in range(1, 6)),
}
LABEL_WORDS = {
    "retrieve": ("Yes", "No", "Continue"),
    "isrel": ("Relevant", "Irrelevant"),
    "issup": ("Fully", "Partially", "No"),
    "isuse": ("1", "2", "3", "4", "5"),
}


# ------------------------------------------------------------------------------------------------- the scores

def _group(probs: dict | None, group: str) -> np.ndarray | None:
    if not probs or group not in probs or probs[group] is None:
        return None
    p = np.asarray([probs[group].get(label, 0.0) for label in GROUPS[group]], dtype=np.float64)
    if (p < 0).any() or not np.isfinite(p).all():
        raise ValueError(f"{group} probabilities must be finite and non-negative; got {p.tolist()}")
    return p


def s_isrel(probs: dict) -> float | None:
    p = _group(probs, "isrel")
    return None if p is None or p.sum() == 0 else float(p[0] / (p[0] + p[1]))


def s_issup(probs: dict) -> float | None:
    p = _group(probs, "issup")
    return None if p is None or p.sum() == 0 else float((p[0] + 0.5 * p[1]) / p.sum())


def s_isuse(probs: dict) -> float | None:
    p = _group(probs, "isuse")
    return None if p is None or p.sum() == 0 else float(np.dot(UTILITY_WEIGHTS, p) / p.sum())


def retrieve_probability(probs: dict) -> float | None:
    """p(Yes) / (p(Yes) + p(No)); None when both are zero or the group is missing."""
    p = _group(probs, "retrieve")
    return None if p is None or p[0] + p[1] == 0 else float(p[0] / (p[0] + p[1]))


def should_retrieve(probs: dict, delta: float) -> tuple[bool, float | None]:
    """(retrieve?, the probability): retrieve when it exceeds delta, or when it is undefined."""
    r = retrieve_probability(probs)
    return (True if r is None else r > delta), r


@dataclass(frozen=True, kw_only=True)
class Weights:
    rel: float = 1.0
    sup: float = 1.0
    use: float = 0.5


def segment_score(p_segment: float, probs: dict, weights: Weights = Weights()) -> float:
    """(p(segment) + w_rel s(IsRel) + w_sup s(IsSup) + w_use s(IsUse)) / (1 + |weights| present): a missing group
    adds neither its term nor its weight, so segments critiqued on different groups share one scale (absolute
    values, so a negative weight cannot shrink the divisor to zero)."""
    if not 0.0 <= p_segment <= 1.0:
        raise ValueError(f"p_segment must be a probability; got {p_segment}")
    total, norm = p_segment, 1.0
    for w, s in ((weights.rel, s_isrel(probs)), (weights.sup, s_issup(probs)), (weights.use, s_isuse(probs))):
        if s is not None:
            total += w * s
            norm += abs(w)
    return total / norm


def kept_probability(generation: Generation, kept: str, llm) -> float:
    """p(segment) of the part of a generation that is kept: the geometric mean of the probabilities of the tokens
    that write `kept` (a prefix of the generation), from the generation's per-token log-probabilities; a backend
    without them gives the whole generation's mean. 0 when nothing is known."""
    lps = generation.token_logprobs
    if lps and hasattr(llm, "prefix_tokens"):
        n = max(1, llm.prefix_tokens(generation.token_ids, kept))
        lp = sum(lps[:n]) / len(lps[:n])
    else:
        lp = generation.mean_logprob
    return min(1.0, math.exp(lp)) if math.isfinite(lp) else 0.0


def path_score(segment_scores: Sequence[float]) -> float:
    """The mean of a path's segment scores (see the module docstring for why not a product)."""
    return float(np.mean(segment_scores)) if len(segment_scores) else -math.inf


# ------------------------------------------------------------------------------------------------ beam search

@dataclass(frozen=True)
class Segment:
    text: str
    passage: int  # index into the passages; -1 without retrieval
    score: float
    p_segment: float = 1.0
    probs: dict = field(default_factory=dict)
    final: bool = False  # the answer ends here
    call: int = -1  # index of the generation that wrote it


@dataclass(frozen=True)
class Path:
    segments: tuple[Segment, ...] = ()

    @property
    def score(self) -> float:
        return path_score([s.score for s in self.segments])

    @property
    def final(self) -> bool:
        return bool(self.segments) and self.segments[-1].final

    @property
    def text(self) -> str:
        return " ".join(s.text.strip() for s in self.segments if s.text.strip())


def beam_search(expand: Callable[[Path], list[Segment]], *, beam_width: int = 2, max_depth: int = 3) -> list[Path]:
    """Segment-level beam search: at each depth, every unfinished path is expanded (one child segment per
    passage), and the best beam_width paths by path_score are kept; finished paths wait in the pool. Returns the
    pool (finished paths and those that reached max_depth), best first. Ties keep expansion order."""
    if beam_width < 1 or max_depth < 1:
        raise ValueError("beam_width and max_depth must be at least 1")
    beam, done = [Path()], []
    for _ in range(max_depth):
        children = [Path(p.segments + (seg,)) for p in beam for seg in expand(p)]
        if not children:
            break
        children.sort(key=lambda p: -p.score)
        beam = children[:beam_width]
        done += [p for p in beam if p.final]
        beam = [p for p in beam if not p.final]
        if not beam:
            break
    pool = done + beam
    pool.sort(key=lambda p: -p.score)
    return pool


def aggregate_options(option_of: Sequence[int | None], scores: Sequence[float], n_options: int) -> np.ndarray:
    """Closed-set tasks: the score of each answer option is the sum of exp(score) over the candidates that chose it
    (positive and monotone in every score, so negative scores cannot invert the ranking); options nobody chose get
    0."""
    agg = np.zeros(n_options)
    for o, s in zip(option_of, scores):
        if o is not None and 0 <= o < n_options:
            agg[o] += math.exp(s)
    return agg


# --------------------------------------------------------------------------------------------------- the critic

def _first_token(tokenizer, word: str) -> int:
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"the tokenizer gives no token for {word!r}")
    return ids[0]


class Critic:
    """Reads the four reflection groups from a LocalLLM's next-token probabilities: batched, one forward pass per
    batch of prompts, no sampling, no top-k truncation."""

    def __init__(self, llm) -> None:
        from certrag.protocols import TokenLLM

        if not isinstance(llm, TokenLLM):
            raise TypeError("self_rag needs a local model with the full next-token distribution (certrag LocalLLM); "
                            "an OpenAI-compatible server does not expose it")
        self.llm = llm
        tok = llm.tokenizer
        vocab = tok.get_vocab()
        self.reflection = all(t in vocab for group in REFLECTION_TOKENS.values() for t in group)
        if self.reflection:
            self.label_ids = {g: [vocab[t] for t in REFLECTION_TOKENS[g]] for g in GROUPS}
        else:
            self.label_ids = {g: [_first_token(tok, w) for w in LABEL_WORDS[g]] for g in GROUPS}
            for g, ids in self.label_ids.items():
                if len(set(ids)) != len(ids):
                    raise ValueError(f"the label words of {g} share a first token: {LABEL_WORDS[g]}")
        self.forward_passes = 0
        self.prompt_tokens = 0

    # prompts ------------------------------------------------------------------------------------------------
    def _chat(self, user: str) -> list[int]:
        return self.llm.prompt_ids([{"role": "user", "content": user}])

    def _raw(self, text: str) -> list[int]:
        return self.llm.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _selfrag_prefix(self, question: str) -> str:
        return f"### Instruction:\n{question}\n\n### Response:\n"

    def prompt(self, group: str, question: str, passage: str | None = None, segment: str | None = None,
               prior: str = "") -> list[int]:
        """The token ids after which the group's label is read. prior: the answer written so far."""
        if self.reflection:
            head = self._selfrag_prefix(question) + prior
            if group == "retrieve":
                return self._raw(head)
            para = f"[Retrieval]<paragraph>{passage}</paragraph>"
            if group == "isrel":
                return self._raw(head + para)
            if group == "issup":
                return self._raw(head + para + "[Relevant]" + segment)
            return self._raw(head + para + "[Relevant]" + segment + "[Fully supported]")
        q = f"Question: {question}"
        if prior:
            q += f"\nAnswer so far: {prior}"
        if group == "retrieve":
            return self._chat(f"{q}\nWould passages from an encyclopedia help to answer this question well? "
                              "Reply with one word: Yes or No.")
        p = f'<passage>\n{escape(passage or "")}\n</passage>\n'
        if group == "isrel":
            return self._chat(f"{p}{q}\nIs the passage relevant to the question: does it hold information useful "
                              "for answering it? Reply with one word: Relevant or Irrelevant.")
        if group == "issup":
            return self._chat(f"{p}{q}\nProposed answer: {segment}\nIs the proposed answer supported by the "
                              "passage? Reply with one word: Fully, Partially or No.")
        return self._chat(f"{q}\nProposed answer: {segment}\nHow useful is the proposed answer to the question, "
                          "from 1 (useless) to 5 (complete and correct)? Reply with one digit.")

    # reading ------------------------------------------------------------------------------------------------
    def read(self, requests: list[tuple[str, list[int]]]) -> list[dict]:
        """requests: (group, prompt ids); returns, per request, {group: {label: probability}} in one batched
        pass over the model."""
        if not requests:
            return []
        all_ids = sorted({t for g, _ in requests for t in self.label_ids[g]})
        col = {t: i for i, t in enumerate(all_ids)}
        probs = self.llm.next_token_probs([ids for _, ids in requests], all_ids)
        self.forward_passes += math.ceil(len(requests) / 16)
        self.prompt_tokens += sum(len(ids) for _, ids in requests)
        out = []
        for (group, _), row in zip(requests, probs):
            out.append({group: {label: float(row[col[t]]) for label, t in zip(GROUPS[group], self.label_ids[group])}})
        return out

    def retrieve(self, question: str, prior: str = "") -> dict:
        return self.read([("retrieve", self.prompt("retrieve", question, prior=prior))])[0]

    def critique(self, question: str, passages: list[str | None], segments: list[str], prior: str = ""
                 ) -> list[dict]:
        """IsRel, IsSup and IsUse for each (passage, segment) pair, all in one batch. A None passage (no retrieval)
        gets IsUse only."""
        reqs, owner = [], []
        for i, (p, s) in enumerate(zip(passages, segments)):
            groups = ("isuse",) if p is None else ("isrel", "issup", "isuse")
            for g in groups:
                reqs.append((g, self.prompt(g, question, p, s, prior)))
                owner.append(i)
        merged = [dict() for _ in passages]
        for i, r in zip(owner, self.read(reqs)):
            merged[i].update(r)
        return merged


def retrieve_probabilities(llm, questions: Sequence[str]) -> np.ndarray:
    """p_retrieve = p(Yes) / (p(Yes) + p(No)) of each question before anything is written, read in one batch."""
    questions = list(questions)
    if not questions:
        raise ValueError("questions must not be empty")
    critic = Critic(llm)
    reads = critic.read([("retrieve", critic.prompt("retrieve", q)) for q in questions])
    p = np.array([retrieve_probability(r) for r in reads], dtype=float)
    if np.isnan(p).any():  # retrieve_probability gave None: no mass on Yes or No
        raise ValueError("the model gives no probability to Yes or No for some question")
    return p


def deltas_for_rates(llm, questions: Sequence[str], rates: Sequence[float], *,
                     probabilities: np.ndarray | None = None) -> list[float]:
    """Adaptive-retrieval thresholds at which the given shares of `questions` retrieve (p_retrieve > delta): the
    (1 - rate) quantiles of p_retrieve over them (`probabilities`, when the caller has read them already).
    Self-RAG's default 0.2 is set for a model trained with reflection tokens; a reader prompted with label words keeps
    p_retrieve in a narrow band (0.37-0.74 for the bundled 0.5B reader over 200 NQ-open train questions), so 0.2
    retrieves for every question. Choose on questions like yours (bench_selfrag does it on the train split), never on
    the ones you report."""
    for r in rates:
        if not 0.0 < r < 1.0:
            raise ValueError(f"rates must be in (0, 1); got {r}")
    p = retrieve_probabilities(llm, questions) if probabilities is None else np.asarray(probabilities, dtype=float)
    return [float(np.quantile(p, 1.0 - r, method="higher")) for r in rates]


# ------------------------------------------------------------------------------------------------ the strategy

@dataclass(frozen=True)
class SelfRag:
    """Self-RAG (Asai et al., 2024) on any local causal LM: adaptive retrieval (retrieve when
    p(Yes)/(p(Yes)+p(No)) > delta), then for each passage a segment, critiqued and scored, kept by a segment-level
    beam search. Closed-set tasks (multiple choice, yes/no) aggregate candidate scores per option."""

    beam_width: int = 2
    max_depth: int = 2
    delta: float = 0.2
    weights: Weights = Weights()
    segment_tokens: int = 32
    drop_unsupported: bool = False  # drop segments whose most probable IsSup label is "No support"
    name: str = "self_rag"

    def with_max_new_tokens(self, n: int) -> "SelfRag":
        """n is each segment's budget."""
        return dataclasses.replace(self, segment_tokens=n)

    def run(self, question: str, passages: Sequence[Passage], llm: LLM, qtype: str = "open",
            options: list[str] | None = None, *, selection: Selection | None = None,
            record_lookback: bool = False) -> StrategyResult:
        passages = list(passages)
        critic = Critic(llm)
        calls: list = []
        trace: list[dict] = []

        def expand(path: Path) -> list[Segment]:
            prior = path.text
            decision_probs = critic.retrieve(question, prior)
            retrieve, p_ret = should_retrieve(decision_probs, self.delta)
            trace.append({"depth": len(path.segments), "retrieve": retrieve, "p_retrieve": p_ret,
                          "probs": decision_probs})
            use = list(range(len(passages))) if retrieve and passages else [-1]
            first_call = len(calls)
            # A segment per passage, decoded together (Self-RAG generates them in parallel; each is greedy-exact).
            gens = generate_all(llm, [plain_messages(question, [passages[i]] if i >= 0 else [], qtype, options)
                                      for i in use], self.segment_tokens, prefix=(prior + " ") if prior else "",
                                record_lookback=record_lookback)
            calls.extend(gens)
            # A path that can go on keeps one sentence per segment; with max_depth 1 nothing continues it, so the
            # segment is the whole generation (the paper's short-form setting: one answer per passage, kept whole).
            texts = [g.text.strip() if self.max_depth == 1 else _segment_text(g.text) for g in gens]
            crit = critic.critique(question, [passages[i].text if i >= 0 else None for i in use], texts, prior)
            out = []
            for j, (i, g, t, probs) in enumerate(zip(use, gens, texts, crit)):
                p_seg = kept_probability(g, t, llm)
                score = segment_score(p_seg, probs, self.weights)
                sup = _group(probs, "issup")
                unsupported = sup is not None and sup.sum() > 0 and int(np.argmax(sup)) == 2
                # final: the model ended its answer within this sentence (closed-set answers are one segment)
                final = (g.finish_reason == "stop" and t == g.text.strip()) or qtype != "open"
                trace.append({"depth": len(path.segments), "passage": i, "segment": t, "probs": probs,
                              "p_segment": p_seg, "score": score, "unsupported": unsupported})
                if self.drop_unsupported and unsupported and i >= 0:
                    continue
                out.append(Segment(text=t, passage=i, score=score, p_segment=p_seg, probs=probs, final=final,
                                   call=first_call + j))
            return out

        pool = beam_search(expand, beam_width=self.beam_width, max_depth=self.max_depth)
        critic_calls = Generation(text="", input_tokens=critic.prompt_tokens, output_tokens=0, seconds=0.0,
                                  finish_reason="critic")
        if not pool:  # every segment was dropped as unsupported
            return StrategyResult(text=UNKNOWN, calls=tuple(calls) + (critic_calls,), rejected=True,
                                  passages_used=0, history=tuple(trace), answer_call=None)
        best = pool[0]
        text = first_line(best.text) if qtype != "open" else best.text
        if qtype in ("multiple_choice", "yes_no"):
            text = self._closed_set(pool, qtype, options, trace) or text
        rejected = is_unknown(text)
        cited = sorted({s.passage for s in best.segments if s.passage >= 0})
        summary = {"chosen": [s.passage for s in best.segments], "score": best.score, "cited_passages": cited,
                   "critic_forward_passes": critic.forward_passes}
        return StrategyResult(text=UNKNOWN if rejected else text, calls=tuple(calls) + (critic_calls,),
                              rejected=rejected, passages_used=len(passages), cited=tuple(cited),
                              answer_call=best.segments[-1].call,
                              history=tuple(trace) + (summary,))

    @staticmethod
    def _closed_set(pool: list[Path], qtype: str, options, trace: list) -> str | None:
        labels = [chr(ord("A") + i) for i in range(len(options))] if qtype == "multiple_choice" else ["yes", "no"]

        def option_of(text: str) -> int | None:
            t = text.strip().lower().strip(".:) ")
            for i, lab in enumerate(labels):
                if t == lab.lower() or t.startswith(lab.lower() + ".") or t.startswith(lab.lower() + ")") or \
                        t.startswith(lab.lower() + " "):
                    return i
            return None

        agg = aggregate_options([option_of(p.text) for p in pool], [p.score for p in pool], len(labels))
        trace.append({"option_scores": dict(zip(labels, agg.tolist()))})
        return labels[int(np.argmax(agg))] if agg.any() else None


def _segment_text(text: str) -> str:
    """The first sentence (or line) of a generation: Self-RAG's segment unit."""
    text = text.strip()
    line = text.splitlines()[0] if text else ""
    for i, ch in enumerate(line):
        if ch in ".!?" and (i + 1 == len(line) or line[i + 1] == " ") and i > 0 and not line[i - 1].isdigit():
            return line[: i + 1]
    return line
