"""Do SAGE's chunks retrieve (and answer) better than fixed-size chunks, where documents are longer than a chunk?

Documents: for each of the first --questions NQ-open test questions, a longer document that embeds its gold passage
among the three other NQ gold passages nearest to it (MiniLM; related topics, so the document reads as several
paragraphs on neighbouring subjects), in an order fixed per question; beside them, as distractors, Wikipedia leads
concatenated in groups of six (certrag.data.corpora.wiki_documents) and full Python documentation pages
(pydoc_documents). Paragraphs are separated by blank lines, as in real documents.

Each chunker splits every document; chunks are embedded with the bundled MiniLM and searched exactly (brute force:
this measures the chunks, not the index). An answer-bearing chunk: from the question's document, overlapping its gold
passage, and holding a gold answer string. Reported per chunker: the chunk count and mean size, recall@k (k = 1, 3,
5 chunks) and recall at equal context tokens (the ranked chunks taken until a budget of 128 / 256 / 512 tokens,
the last chunk cut to fit, so every chunker sends the same number of tokens), and, with --answer-questions, EM / F1
of the bundled reader (plain) from the 256-token context.

Chunkers: SAGE (default sizes 24-256 tokens, its threshold chosen on the head's training documents, every newline a
paragraph break; also without paragraph breaks as hard cuts, and at 64-512), fixed-size (128, 256 tokens), fixed-size
with sentence completion (128, 256), percentile breakpoints (95th); each baseline also with the same paragraph cuts
SAGE makes (a heading joined to the paragraph it heads), so SAGE's margin is not the cuts it alone is given.

    python benchmarks/bench_chunking.py --questions 300 --answer-questions 100
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

BUDGETS = (128, 256, 512)


def chunkers(embedder):
    from certrag.segment import (FixedSizeChunker, PercentileSemanticChunker, Segmenter, SegmenterConfig,
                                 SentenceFixedChunker)

    cuts = dict(newline_is_break=True, paragraph_breaks=True)  # the same paragraph cuts SAGE's default makes
    return {
        "sage 24-256 (default)": Segmenter(embedder=embedder),
        "sage 24-256, threshold 0.05 (best on train for retrieval)": Segmenter(
            embedder=embedder, config=SegmenterConfig(threshold=0.05)),
        "sage 24-256, no paragraph cuts": Segmenter(embedder=embedder,
                                                    config=SegmenterConfig(paragraph_breaks=False)),
        "sage 64-512": Segmenter(embedder=embedder, config=SegmenterConfig(min_tokens=64, max_tokens=512,
                                                                           window_tokens=512)),
        "fixed 128": FixedSizeChunker(128, embedder),
        "fixed 128, paragraph cuts": FixedSizeChunker(128, embedder, **cuts),
        "fixed 256": FixedSizeChunker(256, embedder),
        "fixed 256, paragraph cuts": FixedSizeChunker(256, embedder, **cuts),
        "fixed + sentence completion 128": SentenceFixedChunker(128, embedder),
        "fixed + sentence completion 128, paragraph cuts": SentenceFixedChunker(128, embedder, **cuts),
        "fixed + sentence completion 256": SentenceFixedChunker(256, embedder),
        "fixed + sentence completion 256, paragraph cuts": SentenceFixedChunker(256, embedder, **cuts),
        "percentile breakpoints (95th)": PercentileSemanticChunker(95.0, embedder=embedder),
        "percentile breakpoints (95th), paragraph cuts": PercentileSemanticChunker(95.0, embedder=embedder, **cuts),
    }


def build_documents(items, embedder, wiki_docs: int, py_pages: int):
    """(documents as (id, text), per question: (doc index, gold span start, end))."""
    import numpy as np

    from certrag.data.corpora import pydoc_documents, wiki_documents
    from certrag.data.nq import load_nq_open
    from certrag.data.splits import stable_seed

    pool = sorted({it.gold_text for it in load_nq_open()})
    pv = embedder.embed(pool)
    qv = embedder.embed([it.gold_text for it in items])
    docs, where = [], []
    for it, q in zip(items, qv):
        near = [pool[i] for i in np.argsort(-(pv @ q)) if pool[i] != it.gold_text][:3]
        parts = near + [it.gold_text]
        random.Random(stable_seed(it.question)).shuffle(parts)
        text = "\n\n".join(parts)
        start = text.index(it.gold_text)
        where.append((len(docs), start, start + len(it.gold_text)))
        docs.append((f"nq:{len(docs)}", text))
    docs += [(d.name, "\n\n".join(d.paragraphs)) for d in wiki_documents()[:wiki_docs]]
    docs += [(d.name, "\n\n".join(d.paragraphs)) for d in pydoc_documents()[:py_pages]]
    return docs, where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=300)
    p.add_argument("--answer-questions", type=int, default=0, help="questions answered by the reader (0 = skip)")
    p.add_argument("--wiki-docs", type=int, default=300)
    p.add_argument("--py-pages", type=int, default=80)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--split", default="test", choices=("train", "test"),
                   help="NQ-open split the questions come from (train: for choosing settings)")
    p.add_argument("--sage-thresholds", default="",
                   help="comma-separated thresholds: measure SAGE's default sizes at each instead of every chunker "
                        "(with --split train, to choose the threshold on train)")
    args = p.parse_args()
    _common.pin_threads(1)
    if args.sage_thresholds and args.answer_questions:
        p.error("--sage-thresholds measures retrieval only; leave out --answer-questions")

    import numpy as np

    from _nq import cached_embedder
    from certrag.data.nq import load_nq_open
    from certrag.eval.metrics import answer_in_text, exact_match, f1_score
    from certrag.llm.prompts import Passage
    from certrag.strategies import Plain

    embedder = cached_embedder()
    items = load_nq_open(split=args.split)[: args.questions]
    docs, where = build_documents(items, embedder, args.wiki_docs, args.py_pages)
    qv = embedder.embed([it.question for it in items])
    llm = None
    if args.answer_questions:
        from certrag.llm import LocalLLM

        llm = LocalLLM(args.model)
    rows = []
    if args.sage_thresholds:
        from certrag.segment import Segmenter, SegmenterConfig

        todo = {f"sage 24-256 threshold {t}": Segmenter(embedder=embedder, config=SegmenterConfig(threshold=float(t)))
                for t in args.sage_thresholds.split(",")}
    else:
        todo = chunkers(embedder)
    for name, chunker in todo.items():
        started = time.perf_counter()
        chunks = []  # (doc index, start, end, text, tokens)
        for d, (_, text) in enumerate(docs):
            chunks += [(d, c.start, c.end, text[c.start:c.end], c.n_tokens) for c in chunker.split(text)]
        split_s = time.perf_counter() - started
        vecs = embedder.embed([c[3] for c in chunks])
        tokens = np.array([c[4] for c in chunks])
        owner = np.array([c[0] for c in chunks])
        hits = {f"recall@{k}": [] for k in (1, 3, 5)} | {f"recall@{b} tokens": [] for b in BUDGETS}
        used = {b: [] for b in BUDGETS}
        answers = []
        for qi, (it, q) in enumerate(zip(items, qv)):
            d, g0, g1 = where[qi]
            order = np.argsort(-(vecs @ q))[:50]
            bearing = [owner[i] == d and chunks[i][1] < g1 and chunks[i][2] > g0
                       and answer_in_text(chunks[i][3], it.answers) for i in order]
            for k in (1, 3, 5):
                hits[f"recall@{k}"].append(any(bearing[:k]))
            for b in BUDGETS:  # equal context: ranked chunks until b tokens, the last one cut to fit
                left, context = b, []
                for i in order:
                    if left <= 0:
                        break
                    take = min(int(tokens[i]), left)
                    piece = chunks[i][3][: max(1, round(len(chunks[i][3]) * take / max(int(tokens[i]), 1)))]
                    context.append((i, piece))
                    left -= take
                hits[f"recall@{b} tokens"].append(any(
                    owner[i] == d and chunks[i][1] < g1 and chunks[i][1] + len(piece) > g0
                    and answer_in_text(piece, it.answers) for i, piece in context))
                used[b].append(b - max(left, 0))
                if b == 256 and llm is not None and qi < args.answer_questions:
                    res = Plain().run(it.question, [Passage(piece) for _, piece in context], llm)
                    em = 0.0 if res.rejected else exact_match(res.text, it.answers)
                    f1 = 0.0 if res.rejected else f1_score(res.text, it.answers)
                    answers.append((em, f1, res.rejected))
        row = {"what": "chunking", "chunker": name, "chunks": len(chunks), "mean_tokens": float(tokens.mean()),
               "p10_tokens": float(np.percentile(tokens, 10)), "p90_tokens": float(np.percentile(tokens, 90)),
               "split_s": split_s, **{k: float(np.mean(v)) for k, v in hits.items()},
               **{f"tokens_used@{b}": float(np.mean(used[b])) for b in BUDGETS}}
        if answers:
            row.update(answered=len(answers), em=float(np.mean([a[0] for a in answers])),
                       f1=float(np.mean([a[1] for a in answers])), reject=float(np.mean([a[2] for a in answers])))
        rows.append(row)
        print(row, file=sys.stderr, flush=True)

    meta = _common.meta({"bench": "bench_chunking", "questions": len(items), "documents": len(docs),
                         "split": args.split, "answer_questions": args.answer_questions,
                         "model": args.model if llm else None})
    if args.sage_thresholds:
        text = "\n".join([
            f"### SAGE's threshold on the NQ-open {args.split} split (bench_chunking.py --sage-thresholds)\n",
            f"{len(items)} NQ-open {args.split} questions, bench_chunking's documents and protocol, SAGE at its default "
            "sizes (24-256 tokens) and each threshold.\n",
            _common.markdown_table(["chunker", "chunks", "mean tokens", "recall@1", "recall@5",
                                    *[f"recall @ {b} tok" for b in BUDGETS]],
                                   [[r["chunker"], r["chunks"], r["mean_tokens"], r["recall@1"], r["recall@5"],
                                     *[r[f"recall@{b} tokens"] for b in BUDGETS]] for r in rows]),
            _common.footer(meta)])
        print(text)
        if not args.no_write:
            _common.write_rows(f"bench_chunking-{args.split}-thresholds", rows, meta)
            _common.update_results_md(f"bench_chunking-{args.split}-thresholds", text)
        return
    best = max(rows, key=lambda r: r["recall@256 tokens"])
    sage = rows[0]
    fixed = max((r for r in rows if not r["chunker"].startswith("sage")), key=lambda r: r["recall@256 tokens"])
    same_cuts = max((r for r in rows if r["chunker"].endswith("paragraph cuts") and not r["chunker"].startswith(
        "sage")), key=lambda r: r["recall@256 tokens"])
    headers = ["chunker", "chunks", "mean tokens (p10-p90)", "recall@1", "recall@3", "recall@5",
               *[f"recall @ {b} tok" for b in BUDGETS]]
    table = [[r["chunker"], r["chunks"], f"{r['mean_tokens']:.0f} ({r['p10_tokens']:.0f}-{r['p90_tokens']:.0f})",
              r["recall@1"], r["recall@3"], r["recall@5"], *[r[f"recall@{b} tokens"] for b in BUDGETS]]
             for r in rows]
    if any("em" in r for r in rows):
        headers += ["EM @256", "F1 @256", "reject"]
        for t, r in zip(table, rows):
            t += [r.get("em"), r.get("f1"), r.get("reject")]
    text = "\n".join([
        "### Chunking, measured by what it retrieves (bench_chunking.py)\n",
        f"**Verdict:** at a 256-token context the best chunker is {best['chunker']} (recall "
        f"{best['recall@256 tokens']:.3f}); SAGE's default {sage['recall@256 tokens']:.3f} against the best "
        f"baseline, {fixed['chunker']}, {fixed['recall@256 tokens']:.3f}, and the best baseline given the same "
        f"paragraph cuts, {same_cuts['chunker']}, {same_cuts['recall@256 tokens']:.3f}.\n",
        f"{len(items)} NQ-open test questions, each gold passage inside a document of four NQ passages on neighbouring "
        f"subjects; {len(docs) - len(items)} distractor documents (Wikipedia leads in groups of six, Python "
        "documentation pages); paragraphs separated by blank lines. Exact dense search with the bundled MiniLM. "
        "Rows marked 'paragraph cuts' give a baseline the paragraph cuts SAGE's default makes. "
        "Answer-bearing = from the question's document, overlapping its gold passage, holding a gold answer. "
        "'recall @ B tok' takes the ranked chunks until B tokens, the last one cut to fit (equal context for every "
        "chunker). SAGE's sizes trade as follows: min_tokens keeps headings and one-line paragraphs from becoming "
        "chunks of their own (too little to retrieve on), max_tokens bounds how much unrelated text rides along "
        "with an answer.\n",
        _common.markdown_table(headers, table),
        _common.footer(meta)])
    print(text)
    if not args.no_write:
        _common.write_rows("bench_chunking", rows, meta)
        _common.update_results_md("bench_chunking", text)


if __name__ == "__main__":
    main()
