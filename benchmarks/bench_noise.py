"""Chain-of-Note's noise protocol as the paper runs it (Yu et al., 2023, Table 3 and section 4.3): plain RAG against
Chain-of-Note, paired, at every noise ratio, with random noise, and on questions the store cannot answer.

certrag.eval.qa has the protocol: exactly k = 5 passages; relevant ones are *retrieved* answer-bearing passages
(nothing injected), noisy ones the best-ranked answer-free candidates ("hard"; the paper's noisy retrieved
documents) or random Wikipedia leads of the bundled corpus ("random"); one question set for every ratio (the NQ-open
test questions among the first --scan that have 5 relevant and 5 noisy passages; their number is reported). The
unanswerable condition answers each of the same questions from its top 5 answer-free candidates (the store with
every passage that answers it removed): the paper's "unknown" robustness (its reject rate). Both strategies see the
same passages; reported with 95% bootstrap intervals of EM, reject rate and the paired differences.

Rows are appended to benchmarks/data/bench_noise-<model>-<weights>.jsonl as they are made (a rerun skips the rows made;
--shard i --workers n splits the questions over processes, one core each; --report-only summarises). The report
also keeps them in benchmarks/results/bench_noise-<model>-<weights>.rows.jsonl.gz, from which a run on a fresh clone
continues.

    python benchmarks/bench_noise.py --scan 400 --questions 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

K = 5
STRATEGIES = ("plain", "chain_of_note")
DEFAULT_READER = "qwen2.5-coder-0.5b-instruct"
ARCHIVE_EVERY_S = 600  # a running shard refreshes the committed archive this often


def conditions(args) -> list[tuple[str, object]]:
    ratios = [float(r) for r in args.ratios.split(",") if r]
    random_ratios = [float(r) for r in args.random_ratios.split(",") if r]
    return ([("hard", r) for r in ratios] + [("random", r) for r in random_ratios]
            + ([("unanswerable", "unanswerable")] if args.unanswerable else []))


def runs_ratios(args) -> bool:
    """Whether any noise-ratio condition runs (it decides which questions qualify)."""
    return any(kind != "unanswerable" for kind, _ in conditions(args))


def rows_path(args) -> Path:
    return _common.DATA_DIR / f"bench_noise-{args.model}-{args.weights}.jsonl"


def archive_path(args) -> Path:
    """The committed copy of the per-question rows (benchmarks/data is scratch): a run on a fresh clone starts from
    it, so a long run can be continued anywhere."""
    return _common.RESULTS_DIR / f"bench_noise-{args.model}-{args.weights}.rows.jsonl.gz"


def seed_from_archive(args) -> None:
    _common.seed_rows(rows_path(args), archive_path(args))


def write_archive(args) -> None:
    _common.archive_rows([rows_path(args)], archive_path(args))


def qualifying(engine, scan: int, ratios: bool) -> list:
    """(index, item) of the first `scan` NQ-open test questions that qualify for every condition run: with noise
    ratios, 5 retrieved answer-bearing and 5 answer-free passages (about 15% of questions); with the unanswerable
    condition alone, 5 answer-free ones (nearly all)."""
    from certrag.data.nq import load_nq_open
    from certrag.eval.qa import noise_passages, protocol_retrievals, unanswerable_passages

    out = []
    for i, item in enumerate(load_nq_open(split="test")[:scan]):
        ranked, pool = protocol_retrievals(engine, item.question, K)
        fits = (noise_passages(item, ranked, K, 0.0, relevant_pool=pool) if ratios
                else unanswerable_passages(item, ranked, K))
        if fits is not None:
            out.append((i, item))
    return out


def run(args) -> None:
    _common.pin_threads(1, offset=args.shard or 0)
    from _nq import cached_embedder, nq_store

    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import passage_text
    from certrag.eval.qa import evaluate
    from certrag.llm import LocalLLM
    from certrag.rerank import CrossEncoderReranker

    engine, _ = nq_store(cached_embedder(args.backend), CrossEncoderReranker.default(args.backend))
    engine.llm = LocalLLM(args.model, weights=args.weights, num_threads=1)
    env = _common.kernels(engine)
    print(f"kernels: {env}", file=sys.stderr)
    leads = [passage_text(t, x) for t, x, _ in wiki_leads()]
    qualified = qualifying(engine, args.scan, runs_ratios(args))
    print(f"{len(qualified)} of the first {args.scan} test questions qualify", file=sys.stderr)
    chosen = qualified[:args.questions]
    qualify = {"scan": args.scan, "questions": len(qualified), "ratios": runs_ratios(args)}
    mine = chosen[(args.shard or 0)::args.workers]
    seed_from_archive(args)
    path = rows_path(args)
    done = set()
    if path.exists():
        done = {(r["q"], r["kind"], str(r["ratio"]), r["strategy"]) for r in map(json.loads, path.open())}
    archived = time.monotonic()
    with path.open("a") as out:
        for qi, item in mine:
            retrievals: dict = {}
            for kind, ratio in conditions(args):
                for strategy in STRATEGIES:
                    if (qi, kind, str(ratio), strategy) in done:
                        continue
                    report = evaluate(engine, [item], strategy, noise_ratio=ratio, k=K,
                                      noise="hard" if kind == "unanswerable" else kind, leads=leads,
                                      progress=False, retrievals=retrievals)
                    row = report["rows"][0] if report["rows"] else None
                    out.write(json.dumps({"q": qi, "kind": kind, "ratio": ratio, "strategy": strategy,
                                          "row": row, "kernels": env, "qualify": qualify}) + "\n")
                    out.flush()
            print(f"question {qi} done", file=sys.stderr, flush=True)
            if not args.no_write and time.monotonic() - archived > ARCHIVE_EVERY_S:
                write_archive(args)  # benchmarks/data is scratch: a run cut short keeps what it made
                archived = time.monotonic()


def report(args) -> None:
    import numpy as np

    rows = [json.loads(line) for line in rows_path(args).open()] if rows_path(args).exists() else []
    by: dict = {}
    for r in rows:
        if r["row"] is not None:
            by.setdefault((r["kind"], str(r["ratio"])), {}).setdefault(r["strategy"], {})[r["q"]] = r["row"]

    def paired(kind, ratio) -> set:
        got = by.get((kind, str(ratio)), {})
        return set.intersection(*(set(got.get(s, {})) for s in STRATEGIES)) if got else set()

    # The paper's protocol: one question set for every noise ratio. A run cut short mid-question leaves some of its
    # ratios done and some not; the ratios are compared on the questions every one of them answered.
    noisy = [paired(kind, ratio) for kind, ratio in conditions(args) if kind != "unanswerable"]
    ratio_set = set.intersection(*noisy) if noisy else set()
    table, out_rows = [], []
    for kind, ratio in conditions(args):
        got = by.get((kind, str(ratio)), {})
        qs = sorted(paired(kind, ratio) if kind == "unanswerable" else ratio_set)
        if not qs:
            continue
        em = {s: np.array([0.0 if got[s][q]["rejected"] else got[s][q]["em"] for q in qs]) for s in STRATEGIES}
        rej = {s: np.array([float(got[s][q]["rejected"]) for q in qs]) for s in STRATEGIES}
        mal = {s: np.array([float(got[s][q]["malformed"]) for q in qs]) for s in STRATEGIES}
        d_em, d_rej = em["chain_of_note"] - em["plain"], rej["chain_of_note"] - rej["plain"]
        label = "unanswerable (answer removed)" if kind == "unanswerable" else f"{ratio:.1f} {kind}"

        def ci(v):
            lo, hi = _common.bootstrap(v)
            return f"{v.mean():.3f} [{lo:.2f}, {hi:.2f}]"

        table.append([label, len(qs), f"{qs[0]}-{qs[-1]}", ci(em["plain"]), ci(em["chain_of_note"]), ci(d_em),
                      ci(rej["plain"]), ci(rej["chain_of_note"]), ci(d_rej), f"{mal['chain_of_note'].mean():.2f}"])
        out_rows.append({"what": "noise_protocol", "kind": kind, "ratio": ratio, "n": len(qs),
                         "em_plain": float(em["plain"].mean()), "em_con": float(em["chain_of_note"].mean()),
                         "reject_plain": float(rej["plain"].mean()), "reject_con": float(rej["chain_of_note"].mean()),
                         "em_diff_ci": _common.bootstrap(d_em), "reject_diff_ci": _common.bootstrap(d_rej),
                         "malformed_con": float(mal["chain_of_note"].mean())})
    meta = _common.meta({"bench": "bench_noise", "model": args.model, "weights": args.weights, "scan": args.scan,
                         "questions": args.questions})
    strategies_by_q: dict = {}
    for r in rows:
        strategies_by_q.setdefault(r["q"], set()).add(r["strategy"])
    n_q = sum(1 for got in strategies_by_q.values() if set(STRATEGIES) <= got)  # as the table counts: paired
    provenance = _common.kernel_provenance(rows)
    # How many questions the protocol admits (issue 33 asks for it): recorded by the run in each row since session 29.
    counts = {(r["qualify"]["scan"], r["qualify"]["ratios"], r["qualify"]["questions"]) for r in rows if "qualify" in r}
    qualify = "".join(
        f" Of the first {scan} NQ-open test questions, {n} qualify "
        f"{'for the noise ratios' if ratios else 'for the unanswerable condition alone'}."
        for scan, ratios, n in sorted(counts))
    text = "\n".join([
        f"## Chain-of-Note's noise protocol, as the paper runs it (bench_noise.py, {args.model})\n",
        f"{args.model} ({args.weights}, greedy), NQ-open test questions over bench_retrieval's store; exactly 5 "
        "passages; relevant = retrieved answer-bearing passages (never injected), noisy = the best-ranked "
        "answer-free candidates (hard) or random Wikipedia leads (random). The noise ratios share one question set: "
        "the NQ-open test questions with 5 retrieved answer-bearing and 5 answer-free passages, every ratio answered "
        "by both strategies. Unanswerable: questions answered from their top 5 answer-free candidates (the store "
        "with every passage that answers them removed); run with the ratios, the same questions; run alone, every "
        "question with 5 answer-free candidates, so its set can differ (the 'test questions' column: the first and "
        f"last test-split index used).{qualify} {n_q} questions answered by both strategies in some condition here. "
        "Chain-of-Note is the paper's one pass (certrag.strategies.ChainOfNote default). Cells: mean [95% bootstrap "
        f"interval]; differences are Chain-of-Note minus plain, paired by question.{provenance}\n",
        _common.markdown_table(["noise", "n", "test questions", "EM plain", "EM CoN", "EM CoN - plain",
                                "reject plain", "reject CoN", "reject CoN - plain", "CoN malformed"], table),
        "",
        _common.footer(meta)])
    print(text)
    if not args.no_write and out_rows:
        _common.write_rows(f"bench_noise-{args.model}", out_rows, meta)
        write_archive(args)
        _common.update_results_md(f"bench_noise-{args.model}", text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scan", type=int, default=400, help="NQ-open test questions scanned for qualifying ones")
    p.add_argument("--questions", type=int, default=40, help="qualifying questions answered (at most)")
    p.add_argument("--ratios", default="0,0.2,0.4,0.6,0.8,1.0")
    p.add_argument("--random-ratios", default="0.6,1.0", help="ratios also run with random noise")
    p.add_argument("--no-unanswerable", dest="unanswerable", action="store_false")
    p.add_argument("--model", default=DEFAULT_READER)
    p.add_argument("--weights", default="q8", choices=["q8", "float32"])
    p.add_argument("--backend", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="the embedder's and reranker's backend (auto: bfloat16 where the CPU has it natively)")
    p.add_argument("--workers", type=int, default=1, help="processes (run each with --shard i)")
    p.add_argument("--shard", type=int, default=None)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if not conditions(args):  # before the store and the reader are loaded
        p.error("nothing to run: --ratios and --random-ratios are empty and --no-unanswerable is set")
    if not args.report_only:
        run(args)
    if args.shard is None or args.report_only:
        report(args)


if __name__ == "__main__":
    main()
