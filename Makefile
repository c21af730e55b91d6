# Each target sets itself up: it creates .venv on first use and (re)installs certrag when its build inputs change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.certrag-installed
BUILD_INPUTS := pyproject.toml setup.py CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: demo test test-all bench-index clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) $(BUILD_INPUTS)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m certrag.cli demo

test: $(STAMP)
	$(PY) -m pytest -q

bench-deps: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'

bench-index: bench-deps
	$(PY) benchmarks/bench_index.py

clean:
	rm -rf build certrag/_core*.so *.egg-info
