"""A thin bridge from setuptools to CMake: builds certrag._core and maps kernels/ to certrag.kernels."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("CERTRAG_BUILD_TYPE", "Release")
        configure = [
            "cmake",
            str(ROOT),
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCERTRAG_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        configure += os.environ.get("CERTRAG_CMAKE_ARGS", "").split()
        jobs = str(max(1, os.cpu_count() or 1))
        subprocess.run(configure, cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "--config", build_type, "-j", jobs], cwd=build_temp, check=True)


setup(
    ext_modules=[CMakeExtension("certrag._core")],
    cmdclass={"build_ext": CMakeBuild},
    package_dir={"certrag": "certrag", "certrag.kernels": "kernels"},
    # the data folders are packages of their own (setuptools warns of any importable folder left out of packages);
    # reranker-l3 is no identifier, so it stays data of certrag itself
    packages=[*find_packages(include=["certrag", "certrag.*"]), "certrag.kernels", "certrag.serve.static",
              "certrag.reranker", "certrag.certify.models", "certrag.segment.data"],
    package_data={"certrag.segment.data": ["*.safetensors", "*.json"],
                  "certrag.certify.models": ["*.json"],
                  "certrag.data": ["nq-open-oracle.jsonl.gz", "NQ-OPEN-NOTICE.md"],
                  "certrag.serve.static": ["*.html"],
                  "certrag.reranker": ["*.json", "*.safetensors"],
                  "certrag": ["_core.pyi", "py.typed", "reranker-l3/*.json", "reranker-l3/*.safetensors"]},
)
