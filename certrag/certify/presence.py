"""Does the store hold the answer? A reader asked outright, beside the best retrieval score.

The default certification flags a question whose best candidate scores below its threshold (Engine.support). On NQ-open
test questions that flags 67% of off-topic questions (their answer is nowhere in the store) at 7% of answerable ones;
the rule below, 77% at 8.5% (benchmarks/bench_abstention.py, RESULTS.md). A reader asked "does the passage state the
answer?" about the best candidate adds what the retrieval score cannot see: a passage on the right topic that does not
hold the answer. Its log-odds of "yes" against "no" (one prefill, no generation) and the best score go into a logistic
regression fitted on the NQ-open calibration split (answerable questions against the same questions with every correct
candidate removed); the question is flagged not supported when the regression's value falls below the threshold at which
10% of the calibration's answerable questions are flagged. The rule ships beside the reranker it was fitted with
(certrag/<reranker>/presence-<judge>.json; fitted by certrag.train.presence_rule.fit_rule) and names its judge model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SYSTEM = "You check whether a passage answers a question."
QUESTION = "Does the passage state the answer to the question? Reply with yes or no only."
YES = ("yes", "Yes", " yes", "YES")
NO = ("no", "No", " no", "NO")
FILE = "presence-{judge}.json"  # beside a packaged reranker
FORMAT_VERSION = 1


def messages(question: str, passage: str) -> list[dict]:
    """The judge's chat: the passage, the question, and the yes / no question."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Passage: {passage}\n\nQuestion: {question}\n\n{QUESTION}"}]


def first_token_ids(tokenizer, words: tuple[str, ...]) -> list[int]:
    """The distinct first token ids of `words` (a label word's spellings)."""
    return sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words})


def log_odds(llm, pairs: list[tuple[str, str]]) -> np.ndarray:
    """For each (question, passage), the local model's log-odds that its reply starts with yes rather than no (the
    probabilities of every spelling of each word summed, read from the full softmax after the prompt; one prefill
    each, submitted together). llm: a certrag LocalLLM."""
    if not pairs:
        return np.zeros(0)
    yes, no = first_token_ids(llm.tokenizer, YES), first_token_ids(llm.tokenizer, NO)
    p = llm.next_token_probs([llm.prompt_ids(messages(q, passage)) for q, passage in pairs], yes + no)
    return np.log(p[:, :len(yes)].sum(1) + 1e-9) - np.log(p[:, len(yes):].sum(1) + 1e-9)


@dataclass(frozen=True, kw_only=True)
class PresenceRule:
    """value = intercept + score_weight * best score + judge_weight * log-odds; flagged (not supported) below
    threshold. best score: the best candidate's calibrated score (the calibration's score_transform); log-odds: the
    judge's (log_odds) about that candidate. fit holds how the rule was made and what it measured."""

    judge: str  # the bundled model that judges
    weights: str  # the weight format it was run in
    embedder: str
    reranker: dict | None
    score_transform: str
    score_weight: float
    judge_weight: float
    intercept: float
    threshold: float
    fit: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def value(self, best_score: float, judge_log_odds: float) -> float:
        return float(self.intercept + self.score_weight * best_score + self.judge_weight * judge_log_odds)

    def supported(self, best_score: float, judge_log_odds: float) -> bool:
        return self.value(best_score, judge_log_odds) >= self.threshold

    def save(self, path: str | Path) -> None:
        from certrag.atomic import write_file_atomic

        write_file_atomic(Path(path), (json.dumps(asdict(self), indent=2) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path) -> "PresenceRule":
        data = json.loads(Path(path).read_text())
        if data.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"{path} was written by a newer certrag (format {data['format_version']}); upgrade "
                             "certrag")
        return cls(**data)

    @classmethod
    def shipped(cls, reranker_folder: str | Path | None) -> "PresenceRule | None":
        """The rule shipped beside a packaged reranker (its folder), or None when none was fitted for it."""
        if reranker_folder is None:
            return None
        found = sorted(Path(reranker_folder).glob(FILE.format(judge="*")))
        return cls.load(found[0]) if found else None
