# The course in two commands: `make lab` (set up, open JupyterLab) and `make test` (set up, run every test).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-installed
NOTEBOOK_TIMEOUT ?= 300

.PHONY: setup lab test test-unit test-notebooks slides doctor bench clean

# Reinstalls only when the pinned requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m ipykernel install --sys-prefix --name labsrc --display-name "Python (labsrc course)" >/dev/null
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(PYTHON) -m labsrc.doctor || true
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

test: setup
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests notebooks \
		--nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT) --durations=15

test-unit: setup
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests

test-notebooks: setup
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest notebooks \
		--nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT)

slides: setup
	$(PYTHON) slides/build.py

doctor: setup
	$(PYTHON) -m labsrc.doctor

bench: setup
	$(PYTHON) -m labsrc.bench --compare-loop

clean:
	rm -rf runs slides/build .pytest_cache
