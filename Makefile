# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; GPU users override TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
# llama-cpp-python compiles here. Its default (GGML_NATIVE) builds for every feature the CPU
# advertises, AMX included, which these VMs advertise yet do not run: llama.cpp then segfaults on
# its first batch of more than one token. A portable x86-64 build instead (AVX2, FMA, F16C; no
# AMX); override LLAMA_CMAKE_ARGS for another (pip reuses a wheel it built before: clear its cache).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
STAMP  := $(VENV)/.installed
CONFIG ?= router.toml

.PHONY: install serve test soak load clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: install
	$(BIN)/router serve --config $(CONFIG)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Long runs, not part of `make test`: 64 streams for 2 minutes; 2,000 mixed requests.
soak: install
	$(BIN)/python -m pytest -m soak -s tests/test_soak.py

load: install
	$(BIN)/python -m pytest -m load -s tests/test_load.py

clean:
	rm -rf $(VENV) *.egg-info
