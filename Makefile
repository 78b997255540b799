# Every target sets up its own virtual environment (.venv) from the pinned
# constraints, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast proto bench clean

$(STAMP): setup.cfg setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The main job.
run: $(STAMP)
	$(PY) examples/pipeline_split.py

# The whole test suite.
test: $(STAMP)
	$(PY) -m pytest -q

# Without the multi-process end-to-end tests.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Regenerate the gRPC code in runtime/wire/ from proto/splitrun.proto.
proto: $(STAMP)
	$(PY) -m splitrun.runtime.wire.generate

bench: $(STAMP)
	$(PY) bench/splitter_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
