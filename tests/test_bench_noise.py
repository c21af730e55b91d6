"""bench_noise's bookkeeping (benchmarks/bench_noise.py): the committed rows archive a long run continues from, and
the report's paired reject rates. The model runs are the benchmark's; here the rows are written by hand, so the
expected numbers are counted independently of the report's code."""

import gzip
import json
import sys
from argparse import Namespace

import pytest


@pytest.fixture()
def bench(bench_dirs):
    import bench_noise

    return bench_noise


def _args(**kw):
    base = dict(model="m", weights="q8", ratios="", random_ratios="", unanswerable=True, scan=10, questions=10,
                no_write=True)
    return Namespace(**{**base, **kw})


def _row(q, strategy, rejected, kernels=None):
    row = {"q": q, "kind": "unanswerable", "ratio": "unanswerable", "strategy": strategy,
           "row": {"em": 0.0, "rejected": rejected, "malformed": False}}
    if kernels:
        row["kernels"] = kernels
    return row


def _write_rows(bench, rows):
    path = bench.rows_path(_args())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_archive_round_trips_and_is_byte_stable(bench):
    rows = [_row(q, s, q % 2 == 0) for q in range(3) for s in ("plain", "chain_of_note")]
    path = _write_rows(bench, rows)
    bench.write_archive(_args())
    first = bench.archive_path(_args()).read_bytes()
    bench.write_archive(_args())
    assert bench.archive_path(_args()).read_bytes() == first  # the same rows give the same bytes (no mtime)
    assert gzip.decompress(first).decode() == path.read_text()

    path.unlink()
    bench.seed_from_archive(_args())  # a fresh clone: benchmarks/data is empty
    assert [json.loads(line) for line in path.open()] == rows
    assert not list(path.parent.glob("*.tmp"))


def test_the_archive_keeps_whole_rows_while_a_shard_is_writing_one(bench):
    rows = [_row(q, "plain", False) for q in range(2)]
    path = _write_rows(bench, rows)
    with path.open("a") as out:
        out.write(json.dumps(_row(2, "plain", True))[:20])  # a second shard mid-write
    bench.write_archive(_args())
    archived = gzip.decompress(bench.archive_path(_args()).read_bytes()).decode()
    assert [json.loads(line) for line in archived.splitlines()] == rows
    assert not list(bench.archive_path(_args()).parent.glob("*.tmp"))


def test_seeding_keeps_rows_already_there(bench):
    path = _write_rows(bench, [_row(0, "plain", True)])
    bench.write_archive(_args())
    path.write_text(path.read_text() + json.dumps(_row(0, "chain_of_note", False)) + "\n")  # appended since
    bench.seed_from_archive(_args())
    assert len(path.read_text().splitlines()) == 2


def test_the_report_pairs_questions_and_counts_rows_by_kernels(bench, capsys):
    avx2 = {"simd": "avx2", "q8": "avx2", "torch": "AVX2", "encoders": "float32/float32"}
    # q0: both reject; q1: plain only; q2: Chain-of-Note only; q3: neither; q4: plain's row alone (not paired)
    rejects = {0: (True, True), 1: (True, False), 2: (False, True), 3: (False, False)}
    rows = [_row(q, s, r, kernels=avx2 if q >= 2 else None)
            for q, pair in rejects.items() for s, r in zip(("plain", "chain_of_note"), pair)]
    rows.append(_row(4, "plain", True, kernels=avx2))
    _write_rows(bench, rows)
    bench.report(_args())
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("| unanswerable"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "4"  # q4 has no Chain-of-Note row
    assert "4 questions answered by both strategies" in out  # the text counts as the table does
    assert cells[2] == "0-3"  # the first and last test index paired
    assert cells[6].startswith("0.500") and cells[7].startswith("0.500") and cells[8].startswith("0.000")
    assert "not recorded: 2" in out and "simd avx2" in out and ": 3" in out  # q2, q3, q4 were made with AVX2


def test_the_report_says_how_many_questions_qualify(bench, capsys):
    rows = [{**_row(q, s, False), "qualify": {"scan": 400, "questions": 57, "ratios": True}}
            for q in range(2) for s in ("plain", "chain_of_note")]
    rows.append(_row(2, "plain", True))  # a row from before the count was recorded
    _write_rows(bench, rows)
    bench.report(_args())
    assert "Of the first 400 NQ-open test questions, 57 qualify for the noise ratios." in capsys.readouterr().out


def _noisy(q, ratio, strategy, em):
    return {"q": q, "kind": "hard", "ratio": ratio, "strategy": strategy,
            "row": {"em": em, "rejected": False, "malformed": False}}


def test_the_noise_ratios_share_one_question_set_and_unanswerable_keeps_its_own(bench, capsys):
    # q10, q11: both ratios, both strategies. q12: ratio 0.6 done, 1.0 not (a run cut mid-question). Unanswerable
    # ran alone earlier on q0-q2.
    rows = [_noisy(q, r, s, em) for q in (10, 11) for r in (0.6, 1.0)
            for s, em in (("plain", 1.0), ("chain_of_note", float(q == 10)))]
    rows += [_noisy(12, 0.6, "plain", 0.0), _noisy(12, 0.6, "chain_of_note", 1.0)]
    rows += [_row(q, s, q == 0) for q in range(3) for s in ("plain", "chain_of_note")]
    _write_rows(bench, rows)
    bench.report(_args(ratios="0.6,1.0"))
    table = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    # Counted by hand: on q10 and q11 plain is right twice, Chain-of-Note once; q12 would make 0.6's CoN EM 2/3.
    for label in ("0.6 hard", "1.0 hard"):
        assert table[label][1:3] == ["2", "10-11"]
        assert table[label][3].startswith("1.000") and table[label][4].startswith("0.500")
    assert table["unanswerable (answer removed)"][1:3] == ["3", "0-2"]
    assert table["unanswerable (answer removed)"][6].startswith("0.333")


def test_an_empty_run_is_refused_before_anything_loads(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_noise.py", "--ratios", "", "--random-ratios", "", "--no-unanswerable"])
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "nothing to run" in capsys.readouterr().err
