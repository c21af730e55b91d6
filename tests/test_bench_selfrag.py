"""bench_selfrag's run bookkeeping (benchmarks/bench_selfrag.py): which train retrieval rates a run chooses its deltas
for, and where a run with another reader or other rates keeps its rows and its RESULTS.md section, so it never
overwrites the default run's."""

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_selfrag

    return bench_selfrag


def test_rates_are_parsed_and_bad_ones_refused(bench):
    assert bench.parse_rates("0.75,0.5, 0.25") == (0.75, 0.5, 0.25)
    assert bench.parse_rates("0.6") == (0.6,)
    for bad in ("", "1", "0", "0.5,0.5", "-0.2", "half"):
        with pytest.raises(ValueError, match="--rates"):
            bench.parse_rates(bad)


def _args(bench, **kw):
    base = dict(model=bench.DEFAULT_MODEL, questions=60, rates=bench.RATES, depth=2, segment_tokens=32,
                always_retrieve=False)
    return Namespace(**{**base, **kw})


def test_another_reader_or_other_rates_get_their_own_files_and_section(bench):
    default = _args(bench)
    assert bench._section(default) == "bench_selfrag"
    assert bench._stem(default) == f"bench_selfrag-top5-{bench.DEFAULT_MODEL}-60q"
    other = _args(bench, model="qwen2.5-coder-1.5b-instruct", questions=300, rates=(0.75,))
    assert bench._section(other) == "bench_selfrag-qwen2.5-coder-1.5b-instruct-rates0.75"
    assert bench._stem(other) == "bench_selfrag-top5-qwen2.5-coder-1.5b-instruct-300q-rates0.75"
    names = {bench._section(_args(bench, model=m, rates=r))
             for m in (bench.DEFAULT_MODEL, "other") for r in (bench.RATES, (0.5,))}
    assert len(names) == 4


def test_the_short_form_protocol_keeps_its_own_rows_and_adds_the_always_retrieve_condition(bench):
    """The paper's short form (depth 1, 100-token answers) with an always-retrieve condition must not append to, or
    report over, the default beam's rows: its conditions differ."""
    short = _args(bench, model="qwen2.5-coder-1.5b-instruct", questions=300, rates=(0.75,), depth=1,
                  segment_tokens=100, always_retrieve=True)
    assert bench._stem(short) == "bench_selfrag-top5-qwen2.5-coder-1.5b-instruct-300q-rates0.75-d1s100-always"
    assert bench._section(short) == "bench_selfrag-qwen2.5-coder-1.5b-instruct-rates0.75-d1s100-always"
    assert bench._stem(_args(bench, depth=1)) != bench._stem(_args(bench))
    assert bench._stem(_args(bench, always_retrieve=True)) != bench._stem(_args(bench))
    assert bench.conditions([0.8], always=True) == ("plain", "plain top-5", "self_rag top-5 delta=0.8000",
                                                    "self_rag top-5 always")
    assert bench.conditions([0.8]) == ("plain", "plain top-5", "self_rag top-5 delta=0.8000")


@pytest.mark.parametrize("argv, message", [(["--rates", "0.5,1.5"], "--rates"),
                                           (["--critic-questions", "-1"], "--critic-questions"),
                                           (["--depth", "0"], "--depth"),
                                           (["--segment-tokens", "0"], "--segment-tokens")])
def test_bad_arguments_are_refused_before_anything_loads(argv, message):
    out = subprocess.run([sys.executable, str(BENCH / "bench_selfrag.py"), *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and message in out.stderr


def test_adaptive_split_compares_self_rag_and_plain_on_the_questions_each_way_was_taken(bench):
    """Four paired questions: self_rag retrieved for the first two (right on one), answered the last two without
    retrieval (wrong on both); plain top-5 was right on questions 1, 2 and 3. Worked by hand."""
    def rows(ems, retrieved):
        return [{"em": e, "retrieved": r} for e, r in zip(ems, retrieved)]

    out = {"plain": rows([1, 0, 0, 0], [None] * 4),
           "plain top-5": rows([0, 1, 1, 1], [None] * 4),
           "self_rag top-5 delta=0.8": rows([1, 0, 0, 0], [True, True, False, False])}
    split = bench.adaptive_split(out)
    assert split == [
        {"condition": "self_rag top-5 delta=0.8", "retrieved": True, "questions": 2, "em": 0.5, "em_plain_top5": 0.5},
        {"condition": "self_rag top-5 delta=0.8", "retrieved": False, "questions": 2, "em": 0.0,
         "em_plain_top5": 1.0}]
    always = {"plain top-5": rows([1, 0], [None] * 2), "self_rag top-5 delta=0": rows([1, 1], [True, True])}
    assert bench.adaptive_split(always)[1] == {"condition": "self_rag top-5 delta=0", "retrieved": False,
                                              "questions": 0, "em": None, "em_plain_top5": None}


@pytest.fixture()
def scratch(bench, bench_dirs):
    return bench_dirs


def _shard_rows(bench, args, shard, qs):
    import json

    rows = [{"q": q, "condition": c, "em": float(q % 2)} for q in qs for c in ("plain", "plain top-5")]
    bench._shard_path(args, shard).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_a_run_on_a_fresh_clone_continues_from_the_committed_archive(bench, scratch):
    """The rows of every shard and the deltas chosen on train survive benchmarks/data being wiped; a worker's
    half-written row is not archived (it would break every later read)."""
    import json

    args = _args(bench, workers=2, model="m", questions=8)
    rows = _shard_rows(bench, args, 0, (0, 2)) + _shard_rows(bench, args, 1, (1, 3))
    with bench._shard_path(args, 1).open("a") as out:
        out.write('{"q": 5, "condit')  # shard 1 mid-write
    deltas = {"deltas": [0.8], "train_rates": [0.75], "train_questions": 200, "p_retrieve_quantiles": {}}
    bench._deltas_path(args).write_text(json.dumps(deltas))
    bench.write_archive(args)

    for path in (scratch / "data").iterdir():  # a fresh machine
        path.unlink()
    bench.seed_from_archive(args)
    key = lambda r: (r["q"], r["condition"])  # noqa: E731
    assert sorted(bench._rows(args), key=key) == sorted(rows, key=key)
    assert json.loads(bench._deltas_path(args).read_text()) == deltas

    _shard_rows(bench, args, 1, (7,))  # a row made since on this machine: seeding again must not add the archive's
    before = bench._rows(args)
    bench.seed_from_archive(args)
    assert bench._rows(args) == before and {r["q"] for r in before} == {0, 1, 2, 3, 7}


def test_the_report_prints_rates_with_fixed_decimals_and_says_when_there_is_none(bench):
    assert bench._fixed(0.0) == "0.000"
    assert bench._fixed(0.5) == "0.500"
    assert bench._fixed(0.714, 2) == "0.71"
    assert bench._fixed(None) == "n/a"


def test_reading_a_run_mid_write_skips_the_half_written_row(bench, scratch):
    """A report or a --reverse helper reads the shard files while the workers append: a row cut mid-write must be
    left for later, not crash the read."""
    args = _args(bench, workers=2, model="m", questions=8)
    rows = _shard_rows(bench, args, 0, (0,))
    with bench._shard_path(args, 0).open("a") as out:
        out.write('{"q": 2, "condit')
    assert bench._rows(args) == rows
