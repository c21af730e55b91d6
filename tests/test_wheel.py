"""The package as users get it: an sdist built from this checkout, a wheel built from that sdist (so the sdist is
proven complete), installed into a fresh virtual environment, and the README's first example run from a folder
outside the checkout. The fresh environment borrows the test environment's third-party packages (torch,
transformers, ... through a .pth line, which does not carry the checkout's editable install), so it sees only the
wheel's certrag: its compiled core, its shipped models and data."""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel build and a fresh venv

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = textwrap.dedent('''
    import json, pathlib, sys, tempfile
    import certrag
    from certrag.config import EngineConfig
    from certrag.engine import Engine

    assert pathlib.Path(certrag.__file__).resolve().is_relative_to(pathlib.Path(sys.prefix).resolve()), certrag.__file__
    info = certrag.info()
    docs = ["The Nile is the longest river in Africa.", "Mount Everest is the highest mountain on Earth.",
            "Python is a programming language created by Guido van Rossum."]
    with Engine.build(docs, tempfile.mkdtemp() + "/store", EngineConfig(chunker="fixed_sentence"),
                      progress=False) as engine:
        r = engine.retrieve("Which river is the longest?")
    print(json.dumps({"version": info["version"], "top": r.texts[0], "reranked": r.trace["reranked"]}))
''')


def _wheel_tools() -> bool:
    try:
        import build  # noqa: F401
    except ImportError:
        return False
    return shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.mark.skipif(not _wheel_tools(), reason="needs the `build` package and a C++ compiler")
def test_the_wheel_from_the_sdist_installs_into_a_fresh_venv_and_runs_the_readme_example(tmp_path):
    out = tmp_path / "dist"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "build", "--sdist", "-o", str(out), str(ROOT)], check=True,
                   capture_output=True, env=env)
    sdist = next(out.glob("certrag-*.tar.gz"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(sdist)],
                   check=True, capture_output=True, env=env)
    wheel = next(out.glob("certrag-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, env=env)
    away = tmp_path / "elsewhere"
    away.mkdir()
    run = subprocess.run([str(python), "-c", EXAMPLE], cwd=away, capture_output=True, text=True,
                         env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["top"].startswith("The Nile") and result["reranked"] is True
    cli = subprocess.run([str(venv / "bin" / "certrag"), "info", "--json"], cwd=away, capture_output=True, text=True)
    assert cli.returncode == 0 and json.loads(cli.stdout)["version"] == result["version"], cli.stderr[-2000:]
