"""The NQ-open file ships in the package, so nothing outside the repository or the wheel is needed to load it."""

import gzip
import json

from certrag.data import nq


def test_the_bundled_file_lies_inside_the_package_with_its_notice_and_loads_every_line(monkeypatch):
    monkeypatch.delenv("CERTRAG_NQ_PATH", raising=False)
    path = nq.default_path()
    assert path == nq.BUNDLED and path.is_relative_to(nq.Path(nq.__file__).resolve().parent)
    assert (path.parent / "NQ-OPEN-NOTICE.md").read_text().count("CC BY-SA") >= 1
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    items = nq.load_nq_open()
    assert len(items) == len(lines) == 2655
    assert sum(nq.split_counts(items).values()) == len(items)
