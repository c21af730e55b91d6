"""bench_qa's run bookkeeping (benchmarks/bench_qa.py): a resumed or report-only run on a fresh clone continues from
the committed rows archive, and a new run starts with no rows from an earlier one, its helpers' included."""

import json
from argparse import Namespace

import pytest


@pytest.fixture()
def bench(bench_dirs):
    import bench_qa

    return bench_qa


def _args(**kw):
    base = dict(model="m", weights="q8", questions=6, noise_questions=4, scan=10, workers=2, resume=False,
                report_only=False)
    return Namespace(**{**base, **kw})


def _write(bench, args, shard, qs, reverse=False):
    rows = [{"q": q, "condition": c, "row": {"em": float(q % 2)}} for q in qs for c in (0, 1)]
    with bench._shard_path(args, shard, reverse).open("a") as out:
        out.write("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _key(row):
    return row["q"], row["condition"]


@pytest.mark.parametrize("mode", ["resume", "report_only"])
def test_a_run_on_a_fresh_clone_continues_from_the_committed_archive(bench, mode):
    import _common

    args = _args(**{mode: True})
    rows = _write(bench, args, 0, (0, 2)) + _write(bench, args, 1, (1,)) + _write(bench, args, 1, (5,), reverse=True)
    with bench._shard_path(args, 0).open("a") as out:
        out.write('{"q": 4, "cond')  # worker 0 mid-write: not archived
    _common.archive_shards(bench._stem(args), args.workers)

    for path in _common.DATA_DIR.iterdir():  # a fresh machine
        path.unlink()
    bench.start_shards(args)
    assert sorted(bench._records(args), key=_key) == sorted(rows, key=_key)

    _write(bench, args, 1, (3,))  # made since on this machine: starting again must not add the archive twice
    before = bench._records(args)
    bench.start_shards(args)
    assert bench._records(args) == before


def test_a_new_run_starts_with_no_rows_not_even_a_helpers(bench):
    args = _args()
    _write(bench, args, 0, (0,))
    _write(bench, args, 1, (1,))
    _write(bench, args, 1, (3,), reverse=True)  # an earlier run's helper
    bench.start_shards(args)
    assert bench._records(args) == []


def test_runs_of_other_readers_or_sizes_keep_separate_rows(bench):
    names = {bench._stem(_args(**kw)) for kw in ({}, {"model": "other"}, {"weights": "float32"}, {"questions": 7},
                                                    {"noise_questions": 5}, {"scan": 11})}
    assert len(names) == 6
