# The two set-up commands of the README: `make demo` and `make test`. Each creates .venv/ if missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Elsewhere than these machines, PyPI's torch is a multi-GB CUDA build; for the CPU build run e.g.
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: demo test test-slow test-flood lint data venv clean

demo: $(VENV)/.installed data
	$(BIN)/pfl-edge demo

# two workers per two cores (at most 4), each module's tests on one worker (module fixtures such as exported
# programs are made once); the workers share one program directory (tests/conftest.py)
test: $(VENV)/.installed data
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist loadscope --durations=25

# the few tests that must be long (fresh venvs' installs, mobilenet-v1's training export, the soak, replicas,
# a RabbitMQ cluster); CI runs them after make test, two modules at a time (each waits on installs, exports or
# other processes much of its time; a module's tests on one worker: its cluster or run is made once)
test-slow: $(VENV)/.installed data
	$(BIN)/python -m pytest -q -m "slow and not flood" -n 2 --dist loadscope --durations=12

# the tests that flood the machine, alone: beside the slow tier's others they would take its time, not theirs
test-flood: $(VENV)/.installed data
	$(BIN)/python -m pytest -q -m flood --durations=5

lint: $(VENV)/.installed
	$(BIN)/ruff check pfl_edge device_profiles export edge_runtime server tests bench
	$(BIN)/mypy

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_INDEX)" ]; then $(BIN)/python -m pip install -q torch==2.13.0 --index-url $(TORCH_INDEX); fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# Fashion-MNIST comes from Debian's package dataset-fashion-mnist.
data:
	@if [ ! -f $(FMNIST) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	  else \
	    echo "Fashion-MNIST is missing. Install it with:"; \
	    echo "  sudo apt-get update && sudo apt-get install -y dataset-fashion-mnist"; \
	    echo "(or put the four IDX .gz files in a folder and pass --data-dir)"; exit 1; \
	  fi; \
	fi

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
