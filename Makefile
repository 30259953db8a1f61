# Every target sets itself up: a fresh clone needs only `make demo` or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: setup demo test lint bench
setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hspmd demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest
	# again without asserts (python -O): nothing a caller can cause may rest on an assert
	# (tests/conftest.py keeps the tests that expect a failure, where an assert could differ)
	$(PY) -O -m pytest -m "not multiproc" -p no:cacheprovider

bench: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done
