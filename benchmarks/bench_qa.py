"""Answering quality and cost: plain RAG, Chain-of-Note and SAGE's feedback loop with the bundled reader.

On NQ-open test questions (certrag.data.nq) over the store of bench_retrieval.py (gold passages + Wikipedia leads),
with the bundled Qwen2.5-Coder-0.5B-Instruct: plain vs chain_of_note vs feedback(plain) on the engine's own
retrieval, and Chain-of-Note's noise protocol (Yu et al., 2023, Table 3: k = 5 passages, noise ratios 0, 0.5, 1.0)
for plain and chain_of_note. Reported: EM, F1, reject rate, input/output tokens, cost (placeholder price table,
certrag.cost) and cost-efficiency (EM / cost), latency p50; and one question end to end with each stage's share.

Generation is slow on 2 cores (about 6 tokens/s per core), so questions are sharded over --workers processes of one
torch thread each, each pinned to its own core; each worker answers every condition of a question before the next
and appends each row to its shard file in benchmarks/data/ (--resume continues a run, --report-only summarises the
complete questions so far).

    python benchmarks/bench_qa.py --questions 200 --workers 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

# (label, strategy, noise ratio): None = the engine's own retrieval, else Chain-of-Note's noise protocol (k = 5).
CONDITIONS = [("plain", "plain", None), ("chain_of_note", "chain_of_note", None), ("feedback", "feedback", None),
              ("plain", "plain", 0.0), ("plain", "plain", 0.5), ("plain", "plain", 1.0),
              ("chain_of_note", "chain_of_note", 0.0), ("chain_of_note", "chain_of_note", 0.5),
              ("chain_of_note", "chain_of_note", 1.0), ("chain_of_note single-call", "con_single", None)]
# The single-call layout is last: `--conditions 9` leaves it out.


def _strategy(name: str):
    if name == "con_single":  # the paper's one-generation layout, for comparison with the per-passage default
        from certrag.strategies import ChainOfNote

        return ChainOfNote(mode="single")
    return name


def _shard_path(args, shard: int, reverse: bool = False) -> Path:
    return _common.DATA_DIR / (f"bench_qa-{args.model}-{args.dtype}-{args.questions}q-shard{shard}of{args.workers}"
                               f"{'-rev' if reverse else ''}.jsonl")


def _shard_records(args, shard: int) -> list[dict]:
    """The rows of a shard: its own file and the one a helper wrote working from the shard's end (--reverse)."""
    paths = [_shard_path(args, shard), _shard_path(args, shard, reverse=True)]
    return [json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines()]


def worker(args) -> None:
    """Question-major: every condition of a question before the next question, each row appended to the shard's
    JSONL file as it is done (so a run cut short leaves complete, paired questions; --resume continues it)."""
    _common.pin_threads(1, offset=args.shard if args.core is None else args.core)  # one core per worker
    from _nq import cached_embedder, nq_store

    from certrag.data.nq import load_nq_open
    from certrag.eval.qa import evaluate
    from certrag.llm import LocalLLM
    from certrag.rerank import CrossEncoderReranker

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model, dtype=args.dtype)
    indexed = list(enumerate(load_nq_open(split="test")[: args.questions]))[args.shard::args.workers]
    if args.reverse:  # a helper taking a slow shard's questions from its end
        indexed = indexed[::-1]
    path = _shard_path(args, args.shard, args.reverse)
    done = {(r["q"], r["condition"]) for r in _shard_records(args, args.shard)}
    with path.open("a") as out:
        for qi, item in indexed:
            retrievals = {}  # the noise conditions of one question share its retrieval
            for c, (label, strategy, noise) in enumerate(CONDITIONS[: args.conditions]):
                if (qi, c) in done or (args.reverse and (qi, c) in {(r["q"], r["condition"])
                                                                     for r in _shard_records(args, args.shard)}):
                    continue
                row = evaluate(engine, [item], _strategy(strategy), noise_ratio=noise, progress=False,
                               retrievals=retrievals)["rows"][0]
                out.write(json.dumps({"q": qi, "condition": c, "row": row}) + "\n")
                out.flush()
            print(f"shard {args.shard}: question {qi} done", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--conditions", type=int, default=len(CONDITIONS), help="run only the first N conditions")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="the reader's weights (bfloat16 prefills about 2x faster on a CPU with AVX512-BF16)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the shard files")
    p.add_argument("--report-only", action="store_true", help="summarise the shard files as they are")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.shard is not None:
        worker(args)
        return

    from _nq import cached_embedder, nq_store

    from certrag.eval.qa import QARow, markdown, summarise
    from certrag.rerank import CrossEncoderReranker

    if not args.report_only:
        if not args.resume:
            for i in range(args.workers):
                _shard_path(args, i).unlink(missing_ok=True)
                _shard_path(args, i, reverse=True).unlink(missing_ok=True)
        nq_store(cached_embedder(), CrossEncoderReranker.default())[0].close()  # build it once, before the workers
        procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), "--workers", str(args.workers),
                                   "--questions", str(args.questions), "--conditions", str(args.conditions),
                                   "--model", args.model, "--dtype", args.dtype]) for i in range(args.workers)]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a worker failed with exit code {proc.returncode}")
    records = [r for i in range(args.workers) for r in _shard_records(args, i)]
    conditions = CONDITIONS[: args.conditions]
    by_q: dict[int, dict[int, dict]] = {}
    for r in records:
        by_q.setdefault(r["q"], {})[r["condition"]] = r["row"]
    complete = sorted(q for q, rows in by_q.items() if len(rows) == len(conditions))  # paired: every condition
    summaries, all_rows = [], []
    for c, (label, _, noise) in enumerate(conditions):
        rows = [QARow(**{**by_q[q][c], "answers": tuple(by_q[q][c]["answers"])}) for q in complete]
        summaries.append(summarise(rows, label, noise))
        all_rows.append({"strategy": label, "noise": noise, "summary": summaries[-1],
                         "rows": [by_q[q][c] for q in complete]})

    # One question end to end, with each stage's share.
    _common.pin_threads(1)
    from certrag.data.nq import load_nq_open
    from certrag.llm import LocalLLM

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model, dtype=args.dtype)
    q = load_nq_open(split="test")[0].question
    engine.answer(q)  # warm-up
    a = engine.answer(q)
    t = a.trace
    stages = {"embed": t["embed_ms"], "search": t["search_ms"], "rerank": t["rerank_ms"], "select": t["select_ms"],
              "generate": t["generate_ms"]}
    total = sum(stages.values())
    meta = _common.meta({"bench": "bench_qa", "model": args.model, "dtype": args.dtype, "questions": len(complete),
                         "questions_asked": args.questions, "end_to_end_ms": stages})
    by = {(x["strategy"], x["noise_ratio"]): x for x in summaries}

    def em(label, noise):
        x = by.get((label, noise))
        return f"{x['em']:.3f}" if x and x["n"] else "n/a"

    def paired(a, b):  # questions where one strategy is right and the other wrong (same questions, same passages)
        ca = [i for i, (l, _, n) in enumerate(conditions) if (l, n) == a]
        cb = [i for i, (l, _, n) in enumerate(conditions) if (l, n) == b]
        if not ca or not cb:
            return "n/a"
        wins = sum(by_q[q][ca[0]]["em"] > by_q[q][cb[0]]["em"] for q in complete)
        losses = sum(by_q[q][ca[0]]["em"] < by_q[q][cb[0]]["em"] for q in complete)
        return f"{wins} / {losses}"

    text = "\n".join([
        "### Answering strategies (bench_qa.py)\n",
        (f"**Verdict ({len(complete)} questions, every condition on each):** on the engine's own retrieval EM is "
         f"plain {em('plain', None)}, chain_of_note {em('chain_of_note', None)}, feedback(plain) "
         f"{em('feedback', None)}; under the noise protocol (k = 5) plain {em('plain', 0.0)} / {em('plain', 0.5)} / "
         f"{em('plain', 1.0)} and chain_of_note {em('chain_of_note', 0.0)} / {em('chain_of_note', 0.5)} / "
         f"{em('chain_of_note', 1.0)} at noise 0 / 0.5 / 1. Questions chain_of_note gets right and plain wrong / the "
         f"reverse: {paired(('chain_of_note', None), ('plain', None))} (retrieved), "
         f"{paired(('chain_of_note', 0.5), ('plain', 0.5))} (noise 0.5).\n"),
        (f"{args.model} in {args.dtype} (bfloat16 prefills about 2x faster here than float32; the earlier pilot "
         f"was float32), greedy; NQ-open test questions (the first {args.questions}, {len(complete)} complete), "
         "store of bench_retrieval.py. Chain-of-Note runs per passage (a batched one-line note per passage, the "
         "answer from the passages not noted irrelevant, 'unknown' without a call when every passage is): the "
         "paper's one-call layout is ignored by this reader (pilot: 20 of 20 answers without notes). Costs use "
         "certrag's placeholder price table (0.10 / 0.40 per million input / output tokens), so only ratios between "
         "strategies mean anything. 'retrieved' = the engine's reranked, gradient-selected passages; 0.0 / 0.5 / 1.0 "
         "= Chain-of-Note's noise protocol with k = 5 (relevant passages: the gold one and retrieved ones holding an "
         "answer, as many as exist up to k(1-r); the rest hard negatives). p50 s = per answer, two workers on two "
         "cores, one torch thread each.\n"),
        markdown(summaries),
        f"\nOne question end to end ({total:.0f} ms): " + ", ".join(
            f"{k} {v:.0f} ms ({v / total:.0%})" for k, v in stages.items()) + ".\n",
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_qa", all_rows, meta)
        _common.update_results_md("bench_qa", text)


if __name__ == "__main__":
    main()
