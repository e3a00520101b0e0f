# `make demo`: set up .venv and run the seven notebooks on the example dataset into runs/demo/.
# `make test`: set up .venv and run the whole test suite (offline, CPU): what CI runs.
# `make check`: the quick tier while you work: lint, the architecture rules, tests not marked slow.
# `make docs`: the documentation site in site/, from the notebooks `make demo` executed.

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch is enough for the demo and the tests; on a GPU machine install the
# CUDA build of your choice first (pip install torch) and this line keeps it.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test check lint bench clean chromium docs

install: $(STAMP)

# pip -qq: errors only. Its warnings here (setuptools' notes on editable installs, index
# locations of the machine's pip config) say nothing about the kit; a failed install still
# prints its whole error.
PIP := $(BIN)/python -m pip install -qq

$(STAMP): pyproject.toml
	@echo "installing the kit into $(VENV) (minutes, the first time)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)"
	@$(PIP) -e ".[dev,lab,deepspeed]"
	@touch $(STAMP)

# One line per notebook (name, seconds, executed copy), then the learning report.
demo: $(STAMP)
	@rm -rf runs/demo
	@echo "running the seven notebooks on datasets_example into runs/demo/ (a few minutes)"
	@$(BIN)/kit notebooks runs/demo
	@echo "Executed notebooks, loss plot, validation grids and both LoRA files are in runs/demo/"

# The browser test (tests/test_browser.py) drives the system's Chromium, never a downloaded one.
# As root (CI containers), install Debian's package when it is missing; elsewhere, or when the
# install fails, that test skips and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq >/dev/null 2>&1 && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; } || \
		echo "chromium could not be installed; the browser test will be skipped"

# Both tiers spread the tests over every core (pytest-xdist; tests/conftest.py gives each worker
# its share of threads) and print the slowest tests, so every log shows where the time goes.
PYTEST := $(BIN)/python -m pytest -q -n auto

test: $(STAMP) chromium
	$(BIN)/ruff check kit tests benchmarks scripts
	$(PYTEST) --durations=20

check: $(STAMP)
	$(BIN)/ruff check kit tests benchmarks scripts
	$(BIN)/ruff format --check kit tests benchmarks scripts
	$(PYTEST) -m "not slow" --durations=10

lint: $(STAMP)
	$(BIN)/ruff check kit tests benchmarks scripts
	$(BIN)/ruff format --check kit tests benchmarks scripts

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_train.py
	$(BIN)/python benchmarks/bench_data.py
	$(BIN)/python benchmarks/bench_e2e.py

# The site renders the notebooks as `make demo` executed them (runs/demo/notebooks); the family
# pages and the config reference are regenerated from the code first. No network is needed.
docs: $(STAMP)
	@test -d runs/demo/notebooks || \
		{ echo "runs/demo/notebooks is missing: run make demo first (the site shows its executed notebooks)"; exit 1; }
	@$(BIN)/python -c "import mkdocs, material, mkdocs_jupyter" 2>/dev/null || $(PIP) -e ".[docs]"
	@$(BIN)/python scripts/gen_docs.py
	@rm -rf docs/notebooks && mkdir -p docs/notebooks && cp runs/demo/notebooks/*.ipynb docs/notebooks/
	@NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	@echo "Documentation site in site/ (open site/index.html)"

clean:
	rm -rf runs/demo .pytest_cache site docs/notebooks
