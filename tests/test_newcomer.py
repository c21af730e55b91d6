"""scripts/newcomer.py: a clone into an empty folder keeps the README's promises (short form: every run), and with
CERTRAG_LONG_TESTS=1 the README's commands, examples and a wheel install answer from a folder of notes."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "newcomer.py"


def _module():
    spec = importlib.util.spec_from_file_location("newcomer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_finds_a_path_outside_the_repository_and_a_missing_file(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "certrag").mkdir()
    (repo / "README.md").write_text("# x\n\n```bash\nmake demo\nmake test\n```\n\nSee `certrag/data/nope.jsonl`.\n")
    (repo / ".ci" / "run").write_text("make test\n")
    for name in ("Makefile", "pyproject.toml", "setup.py", "MANIFEST.in"):
        (repo / name).write_text("")
    (repo / "certrag" / "demo.py").write_text('DATA = "../shared/data/nq-open-oracle.jsonl.gz"\n')
    problems = _module().short(repo)
    assert any("certrag/demo.py:1 names a path outside the repository" in p for p in problems)
    assert any("names certrag/data/nope.jsonl" in p for p in problems)
    assert any("lacks certrag/data/nq-open-oracle.jsonl.gz" in p for p in problems)


@pytest.mark.slow  # starts a subprocess (git clone; with CERTRAG_LONG_TESTS=1 the whole first hour)
def test_a_fresh_clone_keeps_the_readmes_promises():
    long = os.environ.get("CERTRAG_LONG_TESTS") == "1"
    out = subprocess.run([sys.executable, str(SCRIPT), *(["--long"] if long else [])], capture_output=True,
                         text=True, timeout=3600 if long else 300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "short form: the clone keeps the README's promises" in out.stdout
