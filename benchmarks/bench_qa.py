"""Answering quality and cost: plain RAG, Chain-of-Note and SAGE's feedback loop with the bundled reader.

On NQ-open test questions (certrag.data.nq) over the store of bench_retrieval.py (gold passages + Wikipedia leads),
with the bundled Qwen2.5-Coder-0.5B-Instruct: plain vs chain_of_note vs feedback(plain) on the engine's own
retrieval, and Chain-of-Note's noise protocol (Yu et al., 2023, Table 3: exactly k = 5 passages, noise ratios 0,
0.5 and 1.0; certrag.eval.qa) for plain and chain_of_note. Every strategy has the same "unknown" option and the same
refusal rule, so reject rates compare. Reported: EM, F1, reject rate, input/output tokens, cost (placeholder price
table, certrag.cost) and cost-efficiency (EM / cost), latency p50; for the feedback loop the distribution of the
judge's scores, flags and rounds; and one question end to end with each stage's share.

Which questions each condition runs on:
- the engine's own retrieval and noise 0.5 / 1.0: the first --questions test questions (noise 0.5 needs 2 relevant
  passages, so a question without a second answer-bearing passage is skipped and counted);
- noise 0 (five relevant passages): every question among the first --scan that has five (about 15% do), so that
  the row has enough questions.
Within a ratio plain and chain_of_note see the same questions and the same passages (paired).

Generation is slow on 2 cores (about 6 tokens/s per core), so questions are sharded over --workers processes of one
torch thread each, each pinned to its own core; each worker answers every condition of a question before the next
and appends each row to its shard file in benchmarks/data/ (--resume continues a run, --report-only summarises the
rows so far). The rows are also kept in benchmarks/results/<run>.rows.jsonl.gz (refreshed every 10 minutes while the
workers run), so --resume or --report-only on a fresh clone continues from them.

    python benchmarks/bench_qa.py --questions 200 --noise-questions 100 --scan 700 --workers 2
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# (label, strategy, noise ratio): None = the engine's own retrieval, else the noise protocol (k = 5).
CONDITIONS = [("plain", "plain", None), ("chain_of_note", "chain_of_note", None), ("feedback", "feedback", None),
              ("plain", "plain", 0.0), ("chain_of_note", "chain_of_note", 0.0),
              ("plain", "plain", 1.0), ("chain_of_note", "chain_of_note", 1.0),
              ("plain", "plain", 0.5), ("chain_of_note", "chain_of_note", 0.5)]
K = 5
ARCHIVE_EVERY_S = 600  # a running worker refreshes the committed archive this often
DEFAULT_READER = "qwen2.5-coder-0.5b-instruct"


def _stem(args) -> str:
    return f"bench_qa2-{args.model}-{args.weights}-{args.questions}q-{args.noise_questions}n-{args.scan}s"


def _shard_path(args, shard: int, reverse: bool = False) -> Path:
    return _common.shard_path(_stem(args), shard, args.workers, reverse)


def _records(args) -> list[dict]:
    return _common.shard_rows(_stem(args), args.workers)


def selected_conditions(spec: str) -> list[tuple[int, tuple]]:
    """--conditions: N (the first N) or a comma list of strategy@noise ('plain@1.0,chain_of_note@1.0'; noise
    'retrieved' for the engine's own retrieval), as (index into CONDITIONS, condition) pairs; indices are what the
    shard files record, so a selection and a full run share rows."""
    if spec.isdigit():
        return list(enumerate(CONDITIONS[: int(spec)]))
    chosen = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        label, _, noise = item.partition("@")
        want = None if noise in ("", "retrieved") else float(noise)
        match = [(c, cond) for c, cond in enumerate(CONDITIONS) if cond[0] == label and cond[2] == want]
        if not match:
            raise SystemExit(f"--conditions: no condition {item!r}; choose from "
                             + ", ".join(f"{lab}@{'retrieved' if n is None else n}" for lab, _, n in CONDITIONS))
        chosen += match
    return chosen


def _limit(noise, args) -> int:
    """How many of the first test questions a condition of this noise ratio runs on."""
    if noise == 0.0:
        return args.scan
    return args.questions if noise is None else args.noise_questions


def _wanted(qi: int, noise, args) -> bool:
    return qi < _limit(noise, args)


def worker(args) -> None:
    """Question-major: every condition of a question before the next, each row (or a skip) appended to the shard's
    file as it is done, so a run cut short leaves complete, paired questions; --resume continues it."""
    _common.pin_threads(1, offset=args.shard + args.reverse)  # one core per worker (a helper: the next one)
    from _nq import cached_embedder, nq_store

    from certrag.data.nq import load_nq_open
    from certrag.eval.qa import evaluate
    from certrag.llm import LocalLLM
    from certrag.rerank import CrossEncoderReranker

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model, weights=args.weights)
    env = _common.kernels(engine)
    conditions = selected_conditions(args.conditions)
    last = max(_limit(noise, args) for _, (_, _, noise) in conditions)
    indexed = list(enumerate(load_nq_open(split="test")[:last]))[args.shard::args.workers]
    if args.reverse:  # a helper on a free core, taking a slow shard's questions from its end
        indexed = indexed[::-1]
    path = _shard_path(args, args.shard, args.reverse)
    done = {(r["q"], r["condition"]) for r in _records(args)} if args.resume or args.reverse else set()
    archived = time.monotonic()
    with path.open("a") as out:
        for qi, item in indexed:
            if args.reverse:  # stop where the shard's own worker has got to
                done |= {(r["q"], r["condition"]) for r in _records(args)}
            retrievals = {}  # the noise conditions of one question share its retrievals
            for c, (label, strategy, noise) in conditions:
                if (qi, c) in done or not _wanted(qi, noise, args):
                    continue
                report = evaluate(engine, [item], strategy, noise_ratio=noise, k=K, progress=False,
                                  retrievals=retrievals)
                row = report["rows"][0] if report["rows"] else None  # None: not eligible for this ratio
                out.write(json.dumps({"q": qi, "condition": c, "row": row, "kernels": env}) + "\n")
                out.flush()
            print(f"shard {args.shard}: question {qi} done", file=sys.stderr, flush=True)
            if not args.no_write and time.monotonic() - archived > ARCHIVE_EVERY_S:
                _common.archive_shards(_stem(args), args.workers)  # a run cut short keeps what it made
                archived = time.monotonic()


def start_shards(args) -> None:
    """Before the workers start: a resumed or report-only run continues from the committed archive where this
    machine's shard files are missing (a fresh clone); a new run starts with no shard files, its workers' or their
    helpers'."""
    if args.resume or args.report_only:
        _common.seed_shards(_stem(args), args.workers)
    else:  # helpers' files too: a stale one would join the new run's rows
        for path in _common.shard_paths(_stem(args), args.workers):
            path.unlink(missing_ok=True)


def feedback_distribution(rows: list[dict]) -> dict:
    """The judge's verdicts over the feedback rows: rounds, scores, flags (and how many were defaulted)."""
    rounds = collections.Counter(r["rounds"] for r in rows)
    scores, flags, defaulted, unparsed = collections.Counter(), collections.Counter(), 0, 0
    sources = collections.Counter()
    for r in rows:
        for h in r.get("history") or []:
            if not h.get("judged"):
                continue
            if h["score"] is None:
                unparsed += 1
            else:
                scores[int(h["score"])] += 1
            flags[h["flag"]] += 1
            defaulted += bool(h.get("flag_defaulted"))
            sources[h.get("flag_source", "default" if h.get("flag_defaulted") else "generated")] += 1
    return {"rounds": dict(sorted(rounds.items())), "scores": dict(sorted(scores.items())),
            "flag_sources": dict(sorted(sources.items())),
            "flags": {str(k): v for k, v in sorted(flags.items(), key=lambda kv: str(kv[0]))},
            "flags_defaulted": defaulted, "unparsed_scores": unparsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=200, help="questions for the engine's own retrieval")
    p.add_argument("--noise-questions", type=int, default=100, help="questions for noise 0.5 and 1.0")
    p.add_argument("--scan", type=int, default=700, help="questions scanned for noise 0's five relevant passages")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--conditions", default=str(len(CONDITIONS)),
                   help="the first N conditions, or a list such as plain@1.0,chain_of_note@1.0")
    p.add_argument("--model", default=DEFAULT_READER, help="a bundled reader, e.g. qwen2.5-coder-1.5b-instruct")
    p.add_argument("--weights", default="q8", choices=["q8", "float32"],
                   help="the reader's weight format (certrag.llm.LocalLLM; the engine's default is q8)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the shard files")
    p.add_argument("--report-only", action="store_true", help="summarise the shard files as they are")
    p.add_argument("--below", type=int, default=None,
                   help="summarise only the first N test questions (to pair a run cut short with another reader's)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.shard is not None:
        worker(args)
        return

    from _nq import cached_embedder, nq_store

    from certrag.eval.qa import QARow, markdown, summarise
    from certrag.rerank import CrossEncoderReranker

    start_shards(args)
    if not args.report_only:
        nq_store(cached_embedder(), CrossEncoderReranker.default())[0].close()  # build it once, before the workers
        forwarded = ["--workers", str(args.workers), "--questions", str(args.questions), "--noise-questions",
                     str(args.noise_questions), "--scan", str(args.scan), "--conditions", args.conditions,
                     "--model", args.model, "--weights", args.weights,
                     *(["--resume"] if args.resume else []), *(["--no-write"] if args.no_write else [])]
        procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), *forwarded])
                 for i in range(args.workers)]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a worker failed with exit code {proc.returncode}")
    conditions = dict(selected_conditions(args.conditions))
    by_q: dict[int, dict[int, dict | None]] = {}
    used = [r for r in _records(args) if args.below is None or r["q"] < args.below]
    for r in used:
        by_q.setdefault(r["q"], {})[r["condition"]] = r["row"]

    # Paired sets: within a ratio, the questions every strategy of that ratio has answered (or skipped).
    ratio_conditions = collections.defaultdict(list)
    for c, (_, _, noise) in conditions.items():
        ratio_conditions[noise].append(c)
    summaries, all_rows, counts = [], [], {}
    for noise, cs in ratio_conditions.items():
        complete = sorted(q for q, rows in by_q.items() if all(c in rows for c in cs))
        eligible = [q for q in complete if all(by_q[q][c] is not None for c in cs)]
        counts[noise] = {"asked": len(complete), "eligible": len(eligible)}
        for c in cs:
            label = conditions[c][0]
            rows = [QARow(**{**by_q[q][c], "answers": tuple(by_q[q][c]["answers"])}) for q in eligible]
            summaries.append({**summarise(rows, label, noise), "asked": len(complete)})
            all_rows.append({"strategy": label, "noise": noise, "summary": summaries[-1],
                             "rows": [{**by_q[q][c], "q": q} for q in eligible]})
    fb = next((r for r in all_rows if r["strategy"] == "feedback"), None)
    fb_dist = feedback_distribution(fb["rows"]) if fb else {}

    # One question end to end, with each stage's share.
    _common.pin_threads(1)
    from certrag.data.nq import load_nq_open
    from certrag.llm import LocalLLM

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model, weights=args.weights)
    q = load_nq_open(split="test")[0].question
    engine.answer(q)  # warm-up
    a = engine.answer(q)
    t = a.trace
    stages = {"embed": t["embed_ms"], "search": t["search_ms"], "rerank": t["rerank_ms"], "select": t["select_ms"],
              "generate": t["generate_ms"]}
    total = sum(stages.values())
    meta = _common.meta({"bench": "bench_qa", "model": args.model, "weights": args.weights, "counts": counts,
                         "questions": args.questions, "noise_questions": args.noise_questions, "scan": args.scan,
                         "below": args.below, "feedback": fb_dist, "end_to_end_ms": stages})
    by = {(x["strategy"], x["noise_ratio"]): x for x in summaries}

    def val(label, noise, key="em", fmt="{:.3f}"):
        x = by.get((label, noise))
        return fmt.format(x[key]) if x and x["n"] else "n/a"

    def paired(a, b):  # questions where one strategy is right and the other wrong (same questions, same passages)
        ra = next((r for r in all_rows if (r["strategy"], r["noise"]) == a), None)
        rb = next((r for r in all_rows if (r["strategy"], r["noise"]) == b), None)
        if ra is None or rb is None:
            return "n/a"
        wins = sum(x["em"] > y["em"] for x, y in zip(ra["rows"], rb["rows"]))
        losses = sum(x["em"] < y["em"] for x, y in zip(ra["rows"], rb["rows"]))
        return f"{wins} / {losses}"

    def n_of(noise):
        c = counts.get(noise)
        return f"{c['eligible']} of {c['asked']}" if c else "n/a"

    def verdict() -> str:
        """The headline numbers of the conditions that ran (a run of a few conditions reports only those)."""
        parts = []
        if None in ratio_conditions:
            parts.append(
                f"on the engine's own retrieval ({n_of(None)} questions) EM is plain {val('plain', None)}, "
                f"chain_of_note {val('chain_of_note', None)}, feedback(plain) {val('feedback', None)} (EM / cost: "
                f"plain {val('plain', None, 'cost_efficiency', '{:.3g}')}, feedback "
                f"{val('feedback', None, 'cost_efficiency', '{:.3g}')}); chain_of_note right and plain wrong / the "
                f"reverse: {paired(('chain_of_note', None), ('plain', None))}")
        noise = [r for r in (0.0, 0.5, 1.0) if counts.get(r, {}).get("asked")]
        if noise:
            parts.append("noise protocol, exactly k = 5 passages: " + "; ".join(
                f"at noise {r:.1f} ({n_of(r)} questions eligible) EM plain {val('plain', r)} / chain_of_note "
                f"{val('chain_of_note', r)}, reject rate {val('plain', r, 'reject_rate')} / "
                f"{val('chain_of_note', r, 'reject_rate')}, chain_of_note right and plain wrong / the reverse: "
                f"{paired(('chain_of_note', r), ('plain', r))}" for r in noise))
        return "**Verdict:** " + ". ".join(p[0].upper() + p[1:] for p in parts) + ".\n"

    text = "\n".join([
        "### Answering strategies (bench_qa.py)\n" if args.model == DEFAULT_READER else
        f"### Answering strategies with {args.model} (bench_qa.py --model)\n",
        verdict(),
        (f"{args.model} in {args.weights}, greedy; NQ-open test questions, store of bench_retrieval.py. Every "
         "strategy's prompt offers 'unknown' and every strategy counts it as a rejection by the same rule "
         "(certrag.strategies.is_unknown). Chain-of-Note is the strategy's default: the paper's one pass (a note on "
         "each passage in order, then the answer or 'unknown'; before session 16 the default was per passage, "
         "with check_note). Noise "
         "protocol: exactly 5 passages, noisy = floor(5 r + 1/2) (r = 0.5: 2 relevant + 3 noisy), relevant = "
         "retrieved answer-bearing passages of a 100-deep dense pool (none injected), noisy = the highest-reranked "
         "answer-free candidates; a question qualifies with 5 of each (one set for every ratio; bench_noise.py runs "
         "the full protocol); 'eligible of asked' counts them. Costs use "
         "certrag's placeholder price table (0.10 / 0.40 per million input / output tokens), so only ratios between "
         "strategies mean anything. p50 s = per answer, two workers on two cores, one torch thread each."
         f"{_common.kernel_provenance(used)}\n"),
        markdown(summaries),
        ("\nFeedback loop (judge = the same reader; every round is judged and billed, and the loop stops on a score "
         "above the threshold, SAGE's 'higher than 9'): rounds "
         f"{fb_dist.get('rounds')}; judge scores {fb_dist.get('scores')} ({fb_dist.get('unparsed_scores')} "
         f"without a score); flags {fb_dist.get('flags')}, read from {fb_dist.get('flag_sources')} (generated: the "
         "word on the judge's 'Passages:' line; probabilities: the likelier of its flag words there; default: "
         "neither), of which "
         f"{fb_dist.get('flags_defaulted')} defaulted to +1.\n" if fb_dist else ""),
        f"\nOne question end to end ({total:.0f} ms): " + ", ".join(
            f"{k} {v:.0f} ms ({v / total:.0%})" for k, v in stages.items()) + ".\n",
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        # The default reader's run is bench_qa; another reader's (the deciding conditions) gets its own section.
        name = "bench_qa" if args.model == DEFAULT_READER else f"bench_qa-{args.model}"
        _common.write_rows(name, all_rows, meta)
        _common.archive_shards(_stem(args), args.workers)
        _common.update_results_md(name, text)


if __name__ == "__main__":
    main()
