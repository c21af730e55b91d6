"""Answering quality and cost: plain RAG, Chain-of-Note and SAGE's feedback loop with the bundled reader.

On NQ-open test questions (certrag.eval.nq) over the store of bench_retrieval.py (gold passages + Wikipedia leads),
with the bundled Qwen2.5-Coder-0.5B-Instruct: plain vs chain_of_note vs feedback(plain) on the engine's own
retrieval, and Chain-of-Note's noise protocol (Yu et al., 2023, Table 3: k = 5 passages, noise ratios 0, 0.5, 1.0)
for plain and chain_of_note. Reported: EM, F1, reject rate, input/output tokens, cost (placeholder price table,
certrag.cost) and cost-efficiency (EM / cost), latency p50; and one question end to end with each stage's share.

Generation is slow on 2 cores (about 6 tokens/s per core), so questions are sharded over --workers processes of one
torch thread each.

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

CONDITIONS = [("plain", None), ("chain_of_note", None), ("feedback", None),
              ("plain", 0.0), ("plain", 0.5), ("plain", 1.0),
              ("chain_of_note", 0.0), ("chain_of_note", 0.5), ("chain_of_note", 1.0)]


def worker(args) -> None:
    _common.pin_threads(1)
    from _nq import cached_embedder, nq_store

    from certrag.eval.nq import load_nq_open
    from certrag.eval.qa import evaluate
    from certrag.llm import LocalLLM
    from certrag.rerank import CrossEncoderReranker

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model)
    items = load_nq_open(split="test")[: args.questions][args.shard::args.workers]
    out = []
    for strategy, noise in CONDITIONS[: args.conditions]:
        rep = evaluate(engine, items, strategy, noise_ratio=noise, progress=False)
        out.append({"strategy": strategy, "noise": noise, "rows": rep["rows"]})
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--conditions", type=int, default=len(CONDITIONS), help="run only the first N conditions")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.shard is not None:
        worker(args)
        return

    from _nq import cached_embedder, nq_store

    from certrag.eval.qa import QARow, markdown, summarise
    from certrag.rerank import CrossEncoderReranker

    nq_store(cached_embedder(), CrossEncoderReranker.default())[0].close()  # build it once, before the workers
    procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), "--workers", str(args.workers),
                               "--questions", str(args.questions), "--conditions", str(args.conditions),
                               "--model", args.model], stdout=subprocess.PIPE, text=True)
             for i in range(args.workers)]
    parts = []
    for proc in procs:
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"a worker failed with exit code {proc.returncode}")
        parts.append(json.loads(stdout.strip().splitlines()[-1]))
    summaries, all_rows = [], []
    for c, (strategy, noise) in enumerate(CONDITIONS[: args.conditions]):
        rows = [QARow(**{**r, "answers": tuple(r["answers"])}) for part in parts for r in part[c]["rows"]]
        summaries.append(summarise(rows, strategy, noise))
        all_rows.append({"strategy": strategy, "noise": noise, "summary": summaries[-1]})

    # One question end to end, with each stage's share.
    _common.pin_threads(1)
    from certrag.eval.nq import load_nq_open
    from certrag.llm import LocalLLM

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model)
    q = load_nq_open(split="test")[0].question
    engine.answer(q)  # warm-up
    a = engine.answer(q)
    t = a.trace
    stages = {"embed": t["embed_ms"], "search": t["search_ms"], "rerank": t["rerank_ms"], "select": t["select_ms"],
              "generate": t["generate_ms"]}
    total = sum(stages.values())
    meta = _common.meta({"bench": "bench_qa", "model": args.model, "questions": args.questions,
                         "end_to_end_ms": stages})
    text = "\n".join([
        "### Answering strategies (bench_qa.py)\n",
        f"{args.model}, greedy, NQ-open test questions (first {args.questions}), store of bench_retrieval.py; costs "
        f"use certrag's placeholder price table (0.10 / 0.40 per million input / output tokens), so only ratios "
        f"between strategies mean anything. 'retrieved' = the engine's reranked, gradient-selected passages; "
        f"0.0 / 0.5 / 1.0 = Chain-of-Note's noise protocol with k = 5.\n",
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
