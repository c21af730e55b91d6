"""Every ```python block of README.md runs, in order, each in a fresh namespace (so none leans on a name another
defined), in one subprocess whose working folder holds the files the README names (notes/, article.txt, cal.jsonl).
A block preceded by `<!-- readme-test: REASON -->` is skipped with that reason: a running server (tested in
tests/serve/test_serve.py) or a bundled reader `make test` does not install (it runs when the reader is there)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<skip>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks() -> list[tuple[int, str, str | None]]:
    text = README.read_text()
    return [(text[: m.start("code")].count("\n") + 1, m.group("code"), m.group("skip")) for m in BLOCK.finditer(text)]


def _reader_installed(name: str | None = None) -> bool:
    """Whether a bundled model's packages are installed (default: the default reader)."""
    from certrag.llm.models import BUNDLED_MODELS, DEFAULT_LLM

    try:
        BUNDLED_MODELS[name or DEFAULT_LLM].gguf_parts()
        return True
    except Exception:
        return False


READERS = {"needs the bundled reader": None, "needs the 1.5B reader": "qwen2.5-coder-1.5b-instruct"}


DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
failed = []
for line, code in blocks:
    try:
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
        print(f"ok README.md:{line}", flush=True)
    except BaseException:
        failed.append(line)
        print(f"FAILED README.md:{line}\n" + traceback.format_exc(), flush=True)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow  # starts a subprocess
def test_every_python_block_of_the_readme_runs(tmp_path):
    found = blocks()
    assert len(found) >= 8, "the README's python blocks were not found"
    run, skipped = [], []
    for line, code, skip in found:
        if skip and not (skip in READERS and _reader_installed(READERS[skip])):
            skipped.append((line, skip))
        else:
            run.append((line, code))
    assert all("server" in why or "reader" in why for _, why in skipped), skipped
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "rome.txt").write_text("Rome is the capital of Italy and of the Lazio region.\n")
    (tmp_path / "article.txt").write_text(
        "Hamlet is a tragedy written by William Shakespeare. It is set in Denmark. The play depicts Prince Hamlet "
        "and his attempts to exact revenge.\n\nThe Moon is Earth's only natural satellite. It orbits at an average "
        "distance of 384,400 km. Its surface is covered in craters.\n")
    asks = ["What is the capital of {}?", "Which city is the capital of {}?", "Name the capital city of {}.",
            "{}: what is its capital?", "Tell me the capital of {}.", "Capital of {}?", "Where is the seat of {}?",
            "Which is the main city of {}?"]
    rows = [{"question": a.format(place), "answers": [city]}
            for a in asks for place, city in (("Italy", "Rome"), ("Lazio", "Rome"), ("France", "Paris"))]
    (tmp_path / "cal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "blocks.json").write_text(json.dumps(run))
    (tmp_path / "driver.py").write_text(DRIVER)
    out = subprocess.run([sys.executable, "driver.py", "blocks.json"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert out.stdout.count("ok README.md:") == len(run)
