"""Self-RAG as its paper runs it, beside plain RAG: over the top-5 passages, adaptive retrieval acting on part of the
questions, and the critic measured against labels.

Questions: the first --questions of the NQ-open test split, the store of bench_retrieval.py, the bundled reader
(greedy). Conditions, interleaved per question: plain over the engine's default selection, plain over the top 5, and
self_rag over the top 5 (certrag.strategies.SelfRag: beam 2, depth 2, weights 1 / 1 / 0.5; Self-RAG retrieves the top
5 and writes a segment per passage) at three adaptive-retrieval thresholds delta. The deltas are chosen on the
*train* split, as the quantiles of the retrieval probability p(Yes) / (p(Yes) + p(No)) over --delta-questions train
questions at which 75%, 50% and 25% of them would retrieve (Self-RAG's default 0.2 made this reader retrieve for every
question, so adaptive retrieval never acted). Reported: EM, F1, input / output tokens (the critic's forward passes
count as input tokens), latency p50, and the retrieval rate on test. Self-RAG's Table 2 compares the same way on
PopQA / TriviaQA with a 7B model trained with reflection tokens; the bundled model has none, so its critic reads label
words.

The critic against labels: for --critic-questions test questions, the gold passage (labelled relevant) and up to four
of the best-ranked retrieved passages that are not it and hold no reference answer (labelled irrelevant); s(IsRel)
read for each: accuracy at 0.5, AUROC, and the share called relevant in each class. Critic cost per passage: the
three groups read from one batched forward pass against generating the critique text (8 tokens per group, one call
per group and passage).

Questions are sharded over --workers processes (one torch thread, one core each), each appending its rows to a
file in benchmarks/data (--resume continues a run, --report-only summarises it); the critic's figures are then
computed in one process, alone. The rows and the chosen deltas are also kept in benchmarks/results
(<run>.rows.jsonl.gz, refreshed every 10 minutes while the workers run, and <run>-deltas.json), so --resume or
--report-only on a fresh clone continues from them.

    python benchmarks/bench_selfrag.py --questions 100

The paper's short-form protocol (run_short_form: one answer per passage of at most 100 tokens, the best-scored kept,
scored by "match", a reference answer as written inside the answer; every row records match beside EM and F1), with
a condition that retrieves for every question (the beam without adaptive retrieval):

    python benchmarks/bench_selfrag.py --model qwen2.5-coder-1.5b-instruct --questions 300 --rates 0.75 \\
        --depth 1 --segment-tokens 100 --always-retrieve --critic-questions 0 --cost-questions 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
RATES = (0.75, 0.5, 0.25)  # the train retrieval rates the deltas are chosen for, by default
DEPTH, SEGMENT_TOKENS = 2, 32  # the default beam; the paper's short-form runs are depth 1, 100 tokens


ALWAYS = "self_rag top-5 always"  # the condition that retrieves for every question (the beam alone)
ARCHIVE_EVERY_S = 600  # a running worker refreshes the committed archive this often


def conditions(deltas, always: bool = False) -> tuple[str, ...]:
    return ("plain", "plain top-5", *[f"self_rag top-5 delta={d:.4f}" for d in deltas], *([ALWAYS] if always else []))


def parse_rates(text: str) -> tuple[float, ...]:
    """--rates: comma-separated train retrieval rates, each strictly between 0 and 1, at least one, no repeats."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers; got {text!r}") from None
    if not rates or any(not 0 < r < 1 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--rates must be distinct rates strictly between 0 and 1; got {text!r}")
    return rates


def format_rates(rates, sep: str = ",") -> str:
    return sep.join(f"{r:g}" for r in rates)


def _rates_tag(args) -> str:
    """"" for the default rates, else "-rates..." (other rates choose other deltas, so other conditions)."""
    return "" if tuple(args.rates) == RATES else "-rates" + format_rates(args.rates, "_")


def _protocol_tag(args) -> str:
    """"" for the default beam (depth 2, 32-token segments, no always-retrieve condition), else what differs."""
    default = (args.depth, args.segment_tokens) == (DEPTH, SEGMENT_TOKENS)
    tag = "" if default else f"-d{args.depth}s{args.segment_tokens}"
    return tag + ("-always" if args.always_retrieve else "")


def _stem(args) -> str:
    """A run's files."""
    return f"bench_selfrag-top5-{args.model}-{args.questions}q{_rates_tag(args)}{_protocol_tag(args)}"


def _section(args) -> str:
    """The RESULTS.md section: the bundled default's keeps its name; another reader, other rates or another protocol
    get their own."""
    return ("bench_selfrag" + ("" if args.model == DEFAULT_MODEL else f"-{args.model}") + _rates_tag(args)
            + _protocol_tag(args))


def _shard_path(args, shard: int, reverse: bool = False) -> Path:
    return _common.shard_path(_stem(args), shard, args.workers, reverse)


def _rows(args) -> list[dict]:
    return _common.shard_rows(_stem(args), args.workers)


def _deltas_path(args) -> Path:
    return _common.DATA_DIR / f"{_stem(args)}-deltas.json"


def _deltas_archive(args) -> Path:
    """The committed copy of the deltas a run chose on train (its rows': _common.shards_archive)."""
    return _common.RESULTS_DIR / f"{_stem(args)}-deltas.json"


def write_archive(args) -> None:
    from certrag.atomic import write_file_atomic

    _common.archive_shards(_stem(args), args.workers)
    if _deltas_path(args).exists():
        write_file_atomic(_deltas_archive(args), _deltas_path(args).read_bytes())


def seed_from_archive(args) -> None:
    """A run with no rows here (a fresh clone or machine) starts from its committed archive."""
    from certrag.atomic import write_file_atomic

    if not _deltas_path(args).exists() and _deltas_archive(args).exists():
        write_file_atomic(_deltas_path(args), _deltas_archive(args).read_bytes())
    _common.seed_shards(_stem(args), args.workers)


def choose_deltas(llm, n: int, rates=RATES) -> dict:
    """Deltas at which the given rates of the first n NQ-open train questions would retrieve (quantiles of
    p_retrieve)."""
    import numpy as np

    from certrag.data.nq import load_nq_open
    from certrag.strategies.self_rag import deltas_for_rates, retrieve_probabilities

    questions = [it.question for it in load_nq_open(split="train")[:n]]
    p = retrieve_probabilities(llm, questions)  # read once: the deltas and the reported quantiles come from it
    deltas = deltas_for_rates(llm, questions, rates, probabilities=p)
    return {"deltas": deltas, "train_rates": [float(np.mean(p > d)) for d in deltas], "train_questions": n,
            "p_retrieve_quantiles": {q: float(np.quantile(p, q)) for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)}}


def _top5():
    from certrag.config import SelectionConfig

    return SelectionConfig(method="topk", k=5)


def worker(args) -> None:
    """This shard's questions, every condition of a question before the next, each row appended as it is done (a
    run cut short keeps complete, paired questions; --resume continues it)."""
    _common.pin_threads(1, offset=args.shard + args.reverse)  # a helper: on the next core
    from certrag.data.nq import load_nq_open
    from certrag.eval.metrics import exact_match, f1_score, substring_match
    from certrag.llm import LocalLLM
    from certrag.rerank import CrossEncoderReranker
    from certrag.strategies.self_rag import SelfRag

    from _nq import cached_embedder, nq_store

    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = LocalLLM(args.model)
    top5 = engine.with_settings(selection=_top5())
    deltas = json.loads(_deltas_path(args).read_text())["deltas"]
    path = _shard_path(args, args.shard, args.reverse)
    done = {(r["q"], r["condition"]) for r in _rows(args)} if args.resume or args.reverse else set()
    items = list(enumerate(load_nq_open(split="test")[: args.questions]))[args.shard::args.workers]
    if args.reverse:  # a helper on a free core, taking a slow shard's questions from its end
        items = items[::-1]
    env = _common.kernels(engine)
    runs = {"plain": (engine, "plain"), "plain top-5": (top5, "plain")}
    beam = {"max_depth": args.depth, "segment_tokens": args.segment_tokens}
    runs.update({name: (top5, SelfRag(delta=d, **beam)) for name, d in zip(conditions(deltas)[2:], deltas)})
    if args.always_retrieve:  # p_retrieve is a probability, so it always exceeds -inf
        runs[ALWAYS] = (top5, SelfRag(delta=float("-inf"), **beam))
    archived = time.monotonic()
    with path.open("a") as out:
        for qi, it in items:
            if args.reverse:  # stop where the shard's own worker has got to
                done |= {(r["q"], r["condition"]) for r in _rows(args)}
            retrieval = top5.retrieve(it.question)
            for name, (eng, strategy) in runs.items():
                if (qi, name) in done:
                    continue
                t = time.perf_counter()
                a = eng.answer(it.question, strategy=strategy, retrieval=retrieval if eng is top5 else None)
                hist = a.trace.get("history", [])
                first = next((h for h in hist if "retrieve" in h and "segment" not in h), None)
                row = {"q": qi, "condition": name, "em": exact_match(a.text, it.answers),
                       "f1": f1_score(a.text, it.answers), "match": substring_match(a.text, it.answers),
                       "in": a.input_tokens, "out": a.output_tokens,
                       "s": time.perf_counter() - t, "retrieved": None if first is None else bool(first["retrieve"]),
                       "p_retrieve": None if first is None else first["p_retrieve"],
                       "passages": None if a.retrieval is None else int(a.retrieval.selected),
                       "passes": (hist[-1].get("critic_forward_passes") if hist else None), "kernels": env}
                out.write(json.dumps(row) + "\n")
                out.flush()
            print(f"shard {args.shard}: question {qi} done", file=sys.stderr, flush=True)
            if not args.no_write and time.monotonic() - archived > ARCHIVE_EVERY_S:
                write_archive(args)  # a run cut short keeps what it made, on any clone
                archived = time.monotonic()
    engine.close()


def _fixed(value, digits: int = 3) -> str:
    """A rate for the tables: fixed decimals (so 0 reads 0.000), "n/a" where the condition has none."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def adaptive_split(out: dict[str, list[dict]]) -> list[dict]:
    """Where adaptive retrieval acted: for each self_rag condition, its EM and plain top-5's on the same questions,
    apart for the questions it retrieved for and those it answered without retrieval. out: condition -> rows, paired
    by position (the same question at the same index in every list)."""
    base = out["plain top-5"]
    split = []
    for name, rs in out.items():
        if not name.startswith("self_rag"):
            continue
        for retrieved in (True, False):
            idx = [i for i, r in enumerate(rs) if r["retrieved"] is retrieved]
            split.append({"condition": name, "retrieved": retrieved, "questions": len(idx),
                          "em": sum(rs[i]["em"] for i in idx) / len(idx) if idx else None,
                          "em_plain_top5": sum(base[i]["em"] for i in idx) / len(idx) if idx else None})
    return split


def critic_accuracy(engine, critic, items) -> dict:
    """s(IsRel) on the gold passage (relevant) and on retrieved answer-free passages (irrelevant)."""
    import numpy as np

    from certrag.eval.metrics import answer_in_text
    from certrag.strategies.self_rag import s_isrel
    from certrag.train.factuality import auroc

    y, score = [], []
    for it in items:
        r = engine.retrieve(it.question)
        others = [t for t in r.texts if t != it.gold_text and not answer_in_text(t, it.answers)][:4]
        texts = [it.gold_text] + others
        reads = critic.read([("isrel", critic.prompt("isrel", it.question, t)) for t in texts])
        y += [1] + [0] * len(others)
        score += [s_isrel(rd) for rd in reads]
    y, score = np.array(y), np.array(score, dtype=float)
    called = score > 0.5
    return {"what": "critic_accuracy", "questions": len(items), "passages": int(len(y)),
            "relevant": int(y.sum()), "accuracy": float(np.mean(called == (y == 1))), "auroc": auroc(y, score),
            "called_relevant_gold": float(np.mean(called[y == 1])),
            "called_relevant_others": float(np.mean(called[y == 0])),
            "median_s_gold": float(np.median(score[y == 1])), "median_s_others": float(np.median(score[y == 0]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--delta-questions", type=int, default=200, help="train questions the deltas are chosen on")
    p.add_argument("--rates", default=format_rates(RATES),
                   help="train retrieval rates the self_rag deltas are chosen for, one condition each")
    p.add_argument("--critic-questions", type=int, default=60,
                   help="test questions for the critic's accuracy (0: not measured)")
    p.add_argument("--cost-questions", type=int, default=10,
                   help="test questions for the critic's cost (0: not measured)")
    p.add_argument("--depth", type=int, default=DEPTH, help="self_rag's beam depth (segments per answer)")
    p.add_argument("--segment-tokens", type=int, default=SEGMENT_TOKENS, help="each segment's token budget")
    p.add_argument("--always-retrieve", action="store_true",
                   help="also run self_rag retrieving for every question (the beam without adaptive retrieval)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--workers", type=int, default=2, help="processes answering, one torch thread and one core each")
    p.add_argument("--resume", action="store_true", help="keep the rows already in the shard files")
    p.add_argument("--report-only", action="store_true", help="summarise the shard files as they are")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reverse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("questions", "workers", "delta_questions", "depth", "segment_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("critic_questions", "cost_questions"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more")
    try:
        args.rates = parse_rates(args.rates)
    except ValueError as e:
        p.error(str(e))
    if args.shard is not None:
        worker(args)
        return
    _common.pin_threads(1)
    from certrag.llm import LocalLLM

    llm = LocalLLM(args.model)
    if args.resume or args.report_only:
        seed_from_archive(args)
    if not args.report_only:
        import subprocess

        if not args.resume:  # a fresh run: the workers append to empty files, with deltas chosen on train
            for path in _common.shard_paths(_stem(args), args.workers):  # the helpers' files too
                path.unlink(missing_ok=True)
            chosen = choose_deltas(llm, args.delta_questions, args.rates)
            _deltas_path(args).write_text(json.dumps(chosen, indent=2) + "\n")
            print(f"deltas chosen on train: {chosen}", file=sys.stderr, flush=True)
        from _nq import cached_embedder, nq_store
        from certrag.rerank import CrossEncoderReranker

        nq_store(cached_embedder(), CrossEncoderReranker.default())[0].close()  # built once, before the workers
        forwarded = ["--questions", str(args.questions), "--model", args.model, "--workers", str(args.workers),
                     "--rates", format_rates(args.rates), "--depth", str(args.depth),
                     "--segment-tokens", str(args.segment_tokens),
                     *(["--always-retrieve"] if args.always_retrieve else []),
                     *(["--no-write"] if args.no_write else [])]
        procs = [subprocess.Popen([sys.executable, __file__, "--shard", str(i), *forwarded,
                                   *(["--resume"] if args.resume else [])]) for i in range(args.workers)]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"a worker failed with exit code {proc.returncode}")

    import numpy as np

    from certrag.data.nq import load_nq_open
    from certrag.llm.prompts import Passage
    from certrag.rerank import CrossEncoderReranker
    from certrag.strategies.self_rag import GROUPS, LABEL_WORDS, Critic

    from _nq import cached_embedder, nq_store

    chosen = json.loads(_deltas_path(args).read_text())
    names = conditions(chosen["deltas"], args.always_retrieve)
    by_q: dict[int, dict[str, dict]] = {}
    for r in _rows(args):
        by_q.setdefault(r["q"], {})[r["condition"]] = r
    complete = sorted(q for q, rs in by_q.items() if all(c in rs for c in names))  # paired questions only
    out = {name: [by_q[q][name] for q in complete] for name in names}
    if not complete:
        raise SystemExit("no question has every condition answered yet")
    engine, _ = nq_store(cached_embedder(), CrossEncoderReranker.default())
    engine.llm = llm
    items = load_nq_open(split="test")
    rows = []
    base = np.array([r["em"] for r in out["plain top-5"]])
    for name, rs in out.items():
        ret = [r["retrieved"] for r in rs if r["retrieved"] is not None]
        em = np.array([r["em"] for r in rs])
        lo, hi = _common.bootstrap(em - base)
        # match (the paper's short-form metric): rows made before it was recorded have none
        match = float(np.mean([r["match"] for r in rs])) if all("match" in r for r in rs) else None
        rows.append({"what": "selfrag_qa", "condition": name, "questions": len(rs), "em": float(em.mean()),
                     "f1": float(np.mean([r["f1"] for r in rs])), "match": match,
                     "em_minus_plain_top5": float((em - base).mean()),
                     "em_minus_plain_top5_ci": [lo, hi],
                     "passages": float(np.mean([r["passages"] for r in rs if r["passages"] is not None] or [0])),
                     "input_tokens": float(np.mean([r["in"] for r in rs])),
                     "output_tokens": float(np.mean([r["out"] for r in rs])),
                     "p50_s": float(np.median([r["s"] for r in rs])),
                     "retrieval_rate": float(np.mean(ret)) if ret else None,
                     "critic_passes": float(np.mean([r["passes"] for r in rs])) if rs[0]["passes"] is not None
                     else None})

    split = adaptive_split(out)
    critic = Critic(llm)
    accuracy = critic_accuracy(engine, critic, items[: args.critic_questions]) if args.critic_questions else None
    # Critic cost per passage: one batched forward pass against generating the critique text.
    ours, naive, n_pass, naive_steps, n_passages = [], [], 0, 0, 0
    for it in items[: args.cost_questions]:
        r = engine.retrieve(it.question)
        passages = [Passage(t) for t in r.texts[:5]]
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
    critic_rows = [] if not args.cost_questions else [
        {"what": "critic_cost", "method": "certrag critic (one batched forward pass, full softmax)",
         "ms_per_passage": float(np.median(ours) * 1e3), "forward_passes_per_passage": n_pass / n_passages},
        {"what": "critic_cost", "method": "naive (generate the critique text, 3 calls of at most 8 tokens)",
         "ms_per_passage": float(np.median(naive) * 1e3),
         # measured: one forward pass per generated token (the first comes from the prefill's pass)
         "forward_passes_per_passage": naive_steps / n_passages}]
    measured = rows + [{"what": "adaptive_split", **r} for r in split] + ([accuracy] if accuracy else []) + critic_rows
    for r in measured:
        print(r, file=sys.stderr)

    meta = _common.meta({"bench": "bench_selfrag", "model": args.model, "questions": args.questions,
                         "groups": list(GROUPS), "deltas": chosen})
    plain5 = rows[1]
    best = max(rows[2:], key=lambda r: r["em"])

    def ci(r):
        lo, hi = r["em_minus_plain_top5_ci"]
        return f" [{lo:+.3f}, {hi:+.3f}]"

    critic_verdict = "" if accuracy is None else (
        f" The critic calls {accuracy['called_relevant_gold']:.0%} of gold passages and "
        f"{accuracy['called_relevant_others']:.0%} of answer-free retrieved ones relevant (accuracy "
        f"{accuracy['accuracy']:.3f}, AUROC {accuracy['auroc']:.3f}).")
    critic_parts = [] if accuracy is None else [
        f"\nThe critic against labels (IsRel, {accuracy['questions']} test questions: the gold passage = relevant, up "
        f"to four best-ranked retrieved passages without a reference answer = irrelevant; called relevant when "
        f"s(IsRel) > 0.5):\n",
        _common.markdown_table(["passages", "relevant", "accuracy", "AUROC", "gold called relevant",
                                "others called relevant", "median s gold", "median s others"],
                               [[accuracy["passages"], accuracy["relevant"], accuracy["accuracy"], accuracy["auroc"],
                                 accuracy["called_relevant_gold"], accuracy["called_relevant_others"],
                                 accuracy["median_s_gold"], accuracy["median_s_others"]]])]
    if critic_rows:
        critic_parts += [
            f"\nCritic cost per passage (IsRel, IsSup, IsUse) on {args.cost_questions} questions' top-5 passages:\n",
            _common.markdown_table(["method", "ms / passage", "forward passes / passage"],
                                   [[r["method"], r["ms_per_passage"], r["forward_passes_per_passage"]]
                                    for r in critic_rows])]
    text = "\n".join([
        f"### Self-RAG (bench_selfrag.py{'' if args.model == DEFAULT_MODEL else ', ' + args.model})\n",
        f"**Verdict:** over the top 5, the best self_rag ({best['condition']}, retrieving for "
        f"{best['retrieval_rate']:.0%} of test questions) reaches EM {best['em']:.3f} against plain's "
        f"{plain5['em']:.3f} over the same 5 passages (difference {best['em_minus_plain_top5']:+.3f}{ci(best)}) and "
        f"plain's {rows[0]['em']:.3f} over the default selection, at "
        f"{best['input_tokens'] / plain5['input_tokens']:.1f}x plain top-5's input tokens and "
        f"{best['p50_s'] / plain5['p50_s']:.1f}x its latency.{critic_verdict}\n",
        f"{args.model} (no reflection tokens: label words after critique prompts), NQ-open test questions "
        f"(the first {args.questions}; {len(complete)} answered under every condition), store of bench_retrieval.py. "
        f"self_rag: the top 5 reranked passages, a segment per passage ({args.segment_tokens} tokens at most, its "
        f"{'whole generation' if args.depth == 1 else 'first sentence'} kept), beam 2, depth {args.depth}"
        f"{'; always: retrieving for every question' if args.always_retrieve else ''}. match: a reference answer, as "
        f"written, inside the answer (Self-RAG's short-form metric). Deltas chosen on the first "
        f"{chosen['train_questions']} NQ-open *train* questions as the quantiles of p_retrieve at which "
        f"{', '.join(f'{r:.0%}' for r in args.rates)} of them retrieve (train rates "
        f"{', '.join(f'{r:.0%}' for r in chosen['train_rates'])}); Self-RAG's default 0.2 retrieves for every question "
        f"with this reader (p_retrieve quantiles on train: "
        f"{', '.join(f'{k}: {v:.3f}' for k, v in chosen['p_retrieve_quantiles'].items())}). EM - plain top-5: paired "
        f"by question, 95% bootstrap interval. p50 s: per answer, {args.workers} workers on their own cores, one torch "
        f"thread each.{_common.kernel_provenance([by_q[q][c] for q in complete for c in names])}\n",
        _common.markdown_table(["condition", "questions", "passages", "EM", "EM - plain top-5", "F1", "match",
                                "input tokens", "output tokens", "p50 s", "retrieval rate (test)",
                                "critic passes / q"],
                               [[r["condition"], r["questions"], r["passages"], f"{r['em']:.3f}",
                                 f"{r['em_minus_plain_top5']:+.3f}{ci(r)}", f"{r['f1']:.3f}", _fixed(r["match"]),
                                 r["input_tokens"], r["output_tokens"], r["p50_s"], _fixed(r["retrieval_rate"], 2),
                                 "n/a" if r["critic_passes"] is None else r["critic_passes"]]
                                for r in rows]),
        "\nWhere adaptive retrieval acted (each self_rag condition against plain top-5 on the same questions, "
        "apart for the questions it retrieved for and those it answered from the reader alone):\n",
        _common.markdown_table(["condition", "retrieved", "questions", "EM self_rag", "EM plain top-5"],
                               [[r["condition"], "yes" if r["retrieved"] else "no", r["questions"],
                                 _fixed(r["em"]), _fixed(r["em_plain_top5"])] for r in split]),
        *critic_parts,
        _common.footer(meta)])
    print(text)
    engine.close()
    section = _section(args)
    if not args.no_write:
        _common.write_rows(section, measured, meta)
        write_archive(args)
        _common.update_results_md(section, text)


if __name__ == "__main__":
    main()
