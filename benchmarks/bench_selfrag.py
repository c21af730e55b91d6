"""Self-RAG beside plain RAG on the questions of bench_qa.py, and what its critic costs.

Questions: the first --questions of the NQ-open test split (the same as bench_qa.py's first ones), the store of
bench_retrieval.py, the bundled reader (greedy). Conditions, interleaved per question: plain and chain_of_note (the engine's
default selection) and self_rag (certrag.strategies.SelfRag: beam 2, depth 2, weights 1 / 1 / 0.5) at two adaptive-retrieval
thresholds delta (0.2, Self-RAG's default, and 0.5). Reported: EM, F1, input / output tokens (the critic's forward
passes count as input tokens), latency p50, and the retrieval rate (the share of questions where the first
decision was to retrieve). Self-RAG's Table 2 compares the same way on PopQA / TriviaQA, with a 7B model trained
with reflection tokens; the bundled model has none, so its critic reads label words.

Critic cost per passage: the four reflection groups read from one batched forward pass (certrag's critic) against
the naive way (generating the critique text, 8 tokens per group, one call per group and passage), on the same
(question, passage, segment) triples.

Questions are sharded over --workers processes (one torch thread, one core each), each appending its rows to a
file in benchmarks/data (--resume continues a run, --report-only summarises it); the critic's cost is then timed in
one process, alone.

    python benchmarks/bench_selfrag.py --questions 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


CONDITIONS = ("plain", "chain_of_note", "self_rag delta=0.2", "self_rag delta=0.5")


def _stem(args) -> str:
    return f"bench_selfrag-{args.model}-{args.questions}q"


def _shard_path(args, shard: int, reverse: bool = False) -> Path:
    return _common.shard_path(_stem(args), shard, args.workers, reverse)


def _rows(args) -> list[dict]:
    return _common.shard_rows(_stem(args), args.workers)


def _strategy(name: str):
    from certrag.strategies.self_rag import SelfRag

    return SelfRag(delta=float(name.split("=")[1])) if name.startswith("self_rag") else name


def worker(args) -> None:
    """This shard's questions, every condition of a question before the next, each row appended as it is done (a
    run cut short keeps complete, paired questions; --resume continues it)."""
    _common.pin_threads(1, offset=args.shard + args.reverse)  # a helper: on the next core
    from certrag.data.nq import load_nq_open
    from certrag.eval.metrics import exact_match, f1_score
    from certrag.llm import LocalLLM
    from certrag.rerank import CrossEncoderReranker

    from _nq import cached_embedder, nq_store

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model)
    path = _shard_path(args, args.shard, args.reverse)
    done = {(r["q"], r["condition"]) for r in _rows(args)} if args.resume or args.reverse else set()
    items = list(enumerate(load_nq_open(split="test")[: args.questions]))[args.shard::args.workers]
    if args.reverse:  # a helper on a free core, taking a slow shard's questions from its end
        items = items[::-1]
    with path.open("a") as out:
        for qi, it in items:
            if args.reverse:  # stop where the shard's own worker has got to
                done |= {(r["q"], r["condition"]) for r in _rows(args)}
            for name in CONDITIONS:
                if (qi, name) in done:
                    continue
                t = time.perf_counter()
                a = engine.answer(it.question, strategy=_strategy(name))
                hist = a.trace.get("history", [])
                first = next((h for h in hist if "retrieve" in h and "segment" not in h), None)
                row = {"q": qi, "condition": name, "em": exact_match(a.text, it.answers),
                       "f1": f1_score(a.text, it.answers), "in": a.input_tokens, "out": a.output_tokens,
                       "s": time.perf_counter() - t, "retrieved": None if first is None else bool(first["retrieve"]),
                       "p_retrieve": None if first is None else first["p_retrieve"],
                       "passes": (hist[-1].get("critic_forward_passes") if hist else None)}
                out.write(json.dumps(row) + "\n")
                out.flush()
            print(f"shard {args.shard}: question {qi} done", file=sys.stderr, flush=True)
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--critic-questions", type=int, default=10)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--workers", type=int, default=2, help="processes answering, one torch thread and one core each")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the shard files")
    p.add_argument("--report-only", action="store_true", help="summarise the shard files as they are")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.shard is not None:
        worker(args)
        return
    if not args.report_only:
        import subprocess

        if not args.resume:  # a fresh run: the workers append to empty files
            for i in range(args.workers):
                for rev in (False, True):
                    _shard_path(args, i, rev).unlink(missing_ok=True)
        from _nq import cached_embedder, nq_store
        from certrag.rerank import CrossEncoderReranker

        nq_store(cached_embedder(), CrossEncoderReranker.default())[0].close()  # built once, before the workers
        forwarded = ["--questions", str(args.questions), "--model", args.model, "--workers", str(args.workers)]
        procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), *forwarded,
                                   *(["--resume"] if args.resume else [])]) for i in range(args.workers)]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a worker failed with exit code {proc.returncode}")
    _common.pin_threads(1)

    import numpy as np

    from certrag.data.nq import load_nq_open
    from certrag.llm import LocalLLM
    from certrag.llm.prompts import Passage
    from certrag.rerank import CrossEncoderReranker
    from certrag.strategies.self_rag import GROUPS, LABEL_WORDS, Critic

    from _nq import cached_embedder, nq_store

    by_q: dict[int, dict[str, dict]] = {}
    for r in _rows(args):
        by_q.setdefault(r["q"], {})[r["condition"]] = r
    complete = sorted(q for q, rs in by_q.items() if all(c in rs for c in CONDITIONS))  # paired questions only
    out = {name: [by_q[q][name] for q in complete] for name in CONDITIONS}
    if not complete:
        raise SystemExit("no question has every condition answered yet")
    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    llm = LocalLLM(args.model)
    engine.llm = llm
    items = load_nq_open(split="test")[: args.questions]
    rows = []
    for name, rs in out.items():
        ret = [r["retrieved"] for r in rs if r["retrieved"] is not None]
        rows.append({"what": "selfrag_qa", "condition": name, "questions": len(rs),
                     "em": float(np.mean([r["em"] for r in rs])), "f1": float(np.mean([r["f1"] for r in rs])),
                     "input_tokens": float(np.mean([r["in"] for r in rs])),
                     "output_tokens": float(np.mean([r["out"] for r in rs])),
                     "p50_s": float(np.median([r["s"] for r in rs])),
                     "retrieval_rate": float(np.mean(ret)) if ret else None,
                     "critic_passes": float(np.mean([r["passes"] for r in rs])) if rs[0]["passes"] is not None
                     else None})

    # Critic cost per passage: one batched forward pass against generating the critique text.
    critic = Critic(llm)
    ours, naive, n_pass, naive_steps, n_passages = [], [], 0, 0, 0
    for it in items[: args.critic_questions]:
        r = engine.retrieve(it.question)
        passages = [Passage(t) for t in r.selected_texts][:5]
        n_passages += len(passages)
        segment = llm.generate([{"role": "user", "content": it.question}], max_new_tokens=12).text
        before = critic.forward_passes
        t = time.perf_counter()
        critic.critique(it.question, [p.text for p in passages], [segment] * len(passages))
        ours.append((time.perf_counter() - t) / len(passages))
        n_pass += critic.forward_passes - before
        t = time.perf_counter()
        for p_ in passages:
            for g in ("isrel", "issup", "isuse"):
                ids = critic.prompt(g, it.question, p_.text, segment)
                text = llm.tokenizer.decode(ids)
                gen = llm.generate([{"role": "user", "content": text}], max_new_tokens=8)
                naive_steps += gen.output_tokens
                _ = [w for w in LABEL_WORDS[g] if w.lower() in gen.text.lower()]
        naive.append((time.perf_counter() - t) / len(passages))
    critic_rows = [{"what": "critic_cost", "method": "certrag critic (one batched forward pass, full softmax)",
                    "ms_per_passage": float(np.median(ours) * 1e3),
                    "forward_passes_per_passage": n_pass / n_passages},
                   {"what": "critic_cost", "method": "naive (generate the critique text, 3 calls of at most 8 tokens)",
                    "ms_per_passage": float(np.median(naive) * 1e3),
                    # measured: one forward pass per generated token (the first comes from the prefill's pass)
                    "forward_passes_per_passage": naive_steps / n_passages}]
    for r in rows + critic_rows:
        print(r, file=sys.stderr)

    meta = _common.meta({"bench": "bench_selfrag", "model": args.model, "questions": args.questions,
                         "groups": list(GROUPS)})
    plain, sr = rows[0], rows[2]
    text = "\n".join([
        "### Self-RAG (bench_selfrag.py)\n",
        f"**Verdict:** self_rag (delta 0.2) EM {sr['em']:.3f} against plain's {plain['em']:.3f} and "
        f"chain_of_note's {rows[1]['em']:.3f}, at {sr['input_tokens'] / plain['input_tokens']:.1f}x plain's input "
        f"tokens and {sr['p50_s'] / plain['p50_s']:.1f}x its latency; the critic reads a passage's three groups in "
        f"{critic_rows[0]['ms_per_passage']:.0f} ms against {critic_rows[1]['ms_per_passage']:.0f} ms for generating "
        f"the critique ({critic_rows[1]['ms_per_passage'] / critic_rows[0]['ms_per_passage']:.1f}x).\n",
        f"{args.model} (no reflection tokens: label words after critique prompts), NQ-open test questions "
        f"(the first {args.questions}, the same as bench_qa.py's first; {len(complete)} answered under every "
        "condition), store of bench_retrieval.py; self_rag uses the engine's selected passages as its candidates, "
        f"beam 2, depth 2. p50 s: per answer, {args.workers} workers on their own cores, one torch thread each.\n",
        _common.markdown_table(["condition", "questions", "EM", "F1", "input tokens", "output tokens", "p50 s",
                                "retrieval rate", "critic passes / q"],
                               [[r["condition"], r["questions"], r["em"], r["f1"], r["input_tokens"],
                                 r["output_tokens"], r["p50_s"], r["retrieval_rate"], r["critic_passes"]]
                                for r in rows]),
        f"\nCritic cost per passage (IsRel, IsSup, IsUse) on {args.critic_questions} questions' selected passages:\n",
        _common.markdown_table(["method", "ms / passage", "forward passes / passage"],
                               [[r["method"], r["ms_per_passage"], r["forward_passes_per_passage"]]
                                for r in critic_rows]),
        _common.footer(meta)])
    print(text)
    engine.close()
    if not args.no_write:
        _common.write_rows("bench_selfrag", rows + critic_rows, meta)
        _common.update_results_md("bench_selfrag", text)


if __name__ == "__main__":
    main()
