# Every target sets up its own virtual environment (.venv) from the pinned
# constraints, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv graphviz run run-pipeline run-recsys run-parallel lint test test-fast proto bench docs clean

# torchrec goes in with --no-deps: its metadata's `fbgemm-gpu` (the CUDA build)
# would overwrite fbgemm-gpu-cpu's files; its other dependencies come with setup.cfg.
$(STAMP): setup.cfg setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt --no-deps torchrec
	touch $(STAMP)

venv: $(STAMP) graphviz

# graphviz's dot draws plan pictures (`splitrun plan --out plan.svg`, `make docs`,
# tests/launcher/test_render.py). Installed quietly where it is missing and this runs as
# root with apt-get (CI's Debian machines); elsewhere the line says how.
graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing graphviz (dot draws plan pictures) with apt-get"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends graphviz; } >/dev/null 2>&1 \
	      || echo "apt-get could not install graphviz; plan pictures need dot (the test that draws one is skipped)"; \
	  else \
	    echo "graphviz's dot is not installed: plan pictures need it (apt-get install graphviz, dnf install graphviz or brew install graphviz); the test that draws one is skipped"; \
	  fi; }

# The main job: parameter-server training on 2 workers and 1 server.
run: $(STAMP)
	$(VENV)/bin/splitrun launch --workers 2 --servers 1 examples/ps_train.py --min-accuracy 0.95

# The model split three ways (pipeline), next to the unsplit step.
run-pipeline: $(STAMP)
	$(VENV)/bin/splitrun launch --workers 3 examples/pipeline_split.py

# A DLRM-style click model: tables on 2 servers, hot rows cached on the worker.
run-recsys: $(STAMP)
	$(VENV)/bin/splitrun launch --workers 1 --servers 2 examples/recsys_cache.py --min-auc 0.65

# A transformer-style block, tensor parallel over 2 workers, next to the unsplit step.
run-parallel: $(STAMP)
	$(VENV)/bin/splitrun launch --workers 2 examples/tp_train.py

# Static checks: the import contracts in setup.cfg and ruff's rules in ruff.toml.
lint: $(STAMP)
	$(VENV)/bin/lint-imports --no-logo
	$(VENV)/bin/ruff check .

# The static checks, then the whole test suite in 4 pytest-xdist workers, longest
# tests first (tests/run_suites.py and tests/scheduling.py say why).
test: lint graphviz
	$(PY) tests/run_suites.py

# Without the multi-process end-to-end tests (tests/e2e/, whose conftest marks them slow).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --ignore=tests/e2e

# Regenerate the gRPC code in runtime/rpc/wire/ from proto/splitrun.proto.
proto: $(STAMP)
	$(PY) -m splitrun.runtime.rpc.wire.generate

# Every benchmark; each prints JSON (about an hour on 2 cores).
bench: $(STAMP)
	$(PY) bench/splitter_scale.py
	$(PY) bench/transport.py
	$(PY) bench/ps_throughput.py
	$(PY) bench/embedding_cache.py

# The pictures in docs/: the plans of the main job and the pipeline example (needs
# graphviz's dot on PATH: the graphviz target above) and the benchmarks' plots, drawn
# from the runs kept in docs/bench-data/ (bench/record.py keeps a new one).
docs: $(STAMP) graphviz
	$(VENV)/bin/splitrun plan --workers 2 --servers 1 --out docs/img/ps-plan.svg examples/ps_train.py
	$(VENV)/bin/splitrun plan --workers 3 --out docs/img/pipeline-plan.svg examples/pipeline_split.py
	$(PY) bench/plots.py --out docs/img

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .import_linter_cache .ruff_cache *.egg-info
