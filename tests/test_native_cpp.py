"""Builds the pure C++ test driver (csrc/tests/test_core.cpp) with CMake, without Python, and runs it."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None and shutil.which("c++") is None, reason="no C++ toolchain")
@pytest.mark.slow  # starts a subprocess
def test_cpp_core_builds_without_python_and_passes(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        import cmake as cmake_pkg  # the PyPI wheel that the build itself uses

        cmake = str(Path(cmake_pkg.CMAKE_BIN_DIR) / "cmake")
    build = tmp_path / "build"
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), "-DCERTRAG_BUILD_PYTHON=OFF",
                    "-DCERTRAG_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(build), "-j", "2"], check=True, capture_output=True)
    run = subprocess.run([str(build / "certrag_core_tests"), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout
