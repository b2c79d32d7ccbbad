# Every target sets up .venv itself on a fresh machine; a second run reinstalls nothing unless
# pyproject.toml or this Makefile changed.
PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip -q --disable-pip-version-check
# Installs byte-compile (pip's default): where PYTHONDONTWRITEBYTECODE is set, as on CI's
# machines, a module without a .pyc is compiled again by every process that imports it.
INSTALL     := $(PIP) install
STAMP       := $(VENV)/.terrapipe-installed
# The CPU build on this machine's disk; any torch >= 2.1 already in the venv is kept.
TORCH_SPEC  ?= torch==2.13.0
PILLOW_SIMD ?= pillow-simd==12.1.1.post0
# Pillow-SIMD's own install instructions: compile with AVX2 where the CPU has it (without it, its
# SSE4 code). Setting CFLAGS instead would replace the optimisation flags (an -O0 build).
PILLOW_CC   := $(if $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo y),CC="cc -mavx2",)

# pillow-simd installs under Pillow's import name: swap it in, built from source (about 40 s)
# into a wheel of this venv's own (not pip's wheel cache, which may hold a build without AVX2); if
# it cannot build here, plain Pillow stays and everything still works. Every install of the package
# pulls plain Pillow back over it (the dependency is named pillow), so each one is followed by the
# swap. The setup builds the wheel in the background while pip installs the rest (two cores: one
# compiles, one unpacks), and every later swap installs the same wheel.
SIMD_DIR    := $(VENV)/pillow-simd
define build_pillow_simd
rm -rf $(SIMD_DIR) && mkdir -p $(SIMD_DIR) && \
  $(PILLOW_CC) $(PIP) wheel --no-deps --no-cache-dir -w $(SIMD_DIR) "$(PILLOW_SIMD)" \
  > $(SIMD_DIR)/build.log 2>&1
endef
define swap_pillow
	@$(PIP) uninstall -y pillow pillow-simd
	@if ls $(SIMD_DIR)/*.whl >/dev/null 2>&1; then $(INSTALL) --no-deps $(SIMD_DIR)/*.whl; \
	else tail -3 $(SIMD_DIR)/build.log 2>/dev/null; $(INSTALL) pillow; fi
endef

.PHONY: setup bytecode demo test test-full test-cluster soak bench lint clean torch-suite horovod-suite docs

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py terrapipe/pipeline/_jpeg.c Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# Pillow-SIMD's wheel builds beside the installs; a failed install waits for it, then fails.
	@# The package's install also compiles the libjpeg-turbo region decoder (setup.py).
	@( $(build_pillow_simd) ) & simd=$$!; \
	{ $(PY) -c "import torch" 2>/dev/null || $(INSTALL) "$(TORCH_SPEC)"; } && \
	$(INSTALL) -e ".[mpi,bench,dev,horovod]"; rc=$$?; wait $$simd; exit $$rc
	$(swap_pillow)
	@$(PY) -c "import PIL; print('image library:', PIL.__version__)"
	@$(PY) -c "from terrapipe.pipeline import roi_jpeg; print('libjpeg-turbo region decoder:', roi_jpeg.available())"
	@touch $(STAMP)

# The package's own modules (and the tests', the benchmarks' and the examples') byte-compiled, as
# pip compiles every installed one (INSTALL above): where PYTHONDONTWRITEBYTECODE is set, every
# process importing terrapipe compiled its sources again, 0.3-0.4 s of CPU each, and make test
# starts about two hundred. compileall rewrites only what changed since; a source changed after
# it is compiled in memory by Python as before, never run stale. pytest rewrites the test modules
# themselves on its own.
bytecode: setup
	@$(PY) -m compileall -q terrapipe tests benchmarks examples

# The demo's short runs are not results: they go to benchmarks/results/demo/ (git-ignored).
demo: bytecode
	BENCH_RESULTS_DIR=benchmarks/results/demo $(PY) -m benchmarks.kernels --quick
	BENCH_RESULTS_DIR=benchmarks/results/demo $(PY) -m benchmarks.loader --data benchmarks/data_cache/demo \
	  --images 1024 --batches 2 --rounds 1

# The suite runs in two lanes side by side, one per core: the kernel and loader tests beside
# everything else (NOTE [two lanes] in tests/lanes.py); the second lane's report follows the
# first's. PYTEST_ARGS adds options to both, e.g. PYTEST_ARGS="-x -k allreduce".
PYTEST_ARGS ?=

# CI's suite (.ci/run): every test, with rank counts above 2 only where the test asks for them in
# CI (the comm core's load and topology tests); see tests/mpi_plugin.py.
test: bytecode
	$(PY) -m tests.lanes -m "not full" --durations=20 $(PYTEST_ARGS)

# Every test at every rank count it names (about twice as long as `make test` on two cores).
test-full: bytecode
	$(PY) -m tests.lanes $(PYTEST_ARGS)

# Not in CI (about an hour on two cores): the tests that run jobs across an emulated cluster
# (network namespaces joined by shaped links; root, else they skip saying why; part of make test
# too), then every multi-rank suite with its jobs across emulated nodes, at 2 nodes of 1 and of
# 2 ranks, then at 4 nodes of 1 (NOTE [jobs across an emulated cluster] in tests/mpi_plugin.py).
test-cluster: bytecode
	$(PY) -m pytest -m cluster
	$(PY) -m pytest --mpi-cluster 2x1,2x2
	$(PY) -m pytest --mpi-cluster 4x1

# Not in CI: the collectives' stress schedule (tests/comm/stress.py) for SOAK_MINUTES at 2 and 4
# ranks, up to 256 MiB, reporting operations run and resident memory growth per rank.
SOAK_MINUTES ?= 5
soak: setup
	$(VENV)/bin/mpiexec -n 2 $(PY) -m tests.comm.stress --minutes $(SOAK_MINUTES)
	$(VENV)/bin/mpiexec -n 4 $(PY) -m tests.comm.stress --minutes $(SOAK_MINUTES)

bench: setup
	$(PY) -m benchmarks.kernels
	$(PY) -m benchmarks.loader
	$(PY) -m benchmarks.allreduce -n 2
	$(PY) -m benchmarks.allreduce -n 4
	$(PY) -m benchmarks.train -n 2
	$(PY) -m benchmarks.gpu_feed
	$(PY) -m benchmarks.cuda_allreduce -n 2

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any warning (a broken
# link, an API page whose object is gone).
DOCS_STAMP  := $(VENV)/.terrapipe-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(INSTALL) -e ".[docs]"
	$(swap_pillow)
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check terrapipe tests benchmarks examples

clean:
	rm -rf $(VENV) benchmarks/results/demo build site
	find terrapipe -name '*.so' -delete
	find . -name __pycache__ -prune -exec rm -rf {} +

# Not in CI (tens of minutes): torch's own distributed suite at world size 2, once over Gloo and
# once over terrapipe, with pass/skip/fail counts for each (tests/distributed/torch_suite.py).
# SUITE_FILTER narrows it (pytest -k), e.g. SUITE_FILTER=all_reduce.
SUITE_FILTER ?=
torch-suite: setup
	@$(INSTALL) expecttest
	@for b in gloo terrapipe; do \
	  echo "== BACKEND=$$b"; tmp=$$(mktemp -d); \
	  BACKEND=$$b WORLD_SIZE=2 TEMP_DIR=$$tmp $(PY) -m pytest -q -p no:randomly tests/distributed/torch_suite.py \
	    $(if $(SUITE_FILTER),-k "$(SUITE_FILTER)") 2>&1 | tail -1; rm -rf $$tmp; \
	done

# Not in CI (about five minutes): Horovod's own test/parallel/test_torch.py, test_timeline.py and
# test_adasum_pytorch.py from a Horovod checkout, against the `horovod` package `terrapipe run
# --horovod` provides, each file its own job at 2 and at 4 ranks as Horovod runs them
# (tests/horovod/suite_plugin.py keeps torch's Muon out of one optimizer sweep), then its
# test/integration/test_interactiverun.py, which starts jobs itself.
# HOROVOD_SRC=<a Horovod checkout> make horovod-suite
HOROVOD_SRC ?=
horovod-suite: setup
	@test -n "$(HOROVOD_SRC)" || { echo "horovod-suite: set HOROVOD_SRC to a Horovod checkout"; exit 2; }
	@$(INSTALL) mock
	@for n in 2 4; do for f in test_torch.py test_timeline.py test_adasum_pytorch.py; do \
	  echo "== $$f at $$n ranks (one line per rank)"; tmp=$$(mktemp); \
	  PYTHONPATH=$(CURDIR)/terrapipe/horovod/compat:$(CURDIR):$(HOROVOD_SRC)/test:$(HOROVOD_SRC)/test/utils \
	    $(VENV)/bin/mpiexec -n $$n $(PY) -m pytest -q -p no:cacheprovider -p tests.horovod.suite_plugin \
	    $(HOROVOD_SRC)/test/parallel/$$f > $$tmp 2>&1; rc=$$?; \
	  grep -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR) " $$tmp; rm -f $$tmp; test $$rc -eq 0 || exit 1; \
	done; done
	@echo "== test/integration/test_interactiverun.py (horovod.run and launch._run; it launches its own jobs)"
	@tmp=$$(mktemp); \
	  PYTHONPATH=$(CURDIR)/terrapipe/horovod/compat:$(CURDIR):$(HOROVOD_SRC)/test:$(HOROVOD_SRC)/test/utils \
	  $(PY) -m pytest -q -p no:cacheprovider $(HOROVOD_SRC)/test/integration/test_interactiverun.py > $$tmp 2>&1; \
	  rc=$$?; grep -E "^[0-9]+ (passed|failed)|^(FAILED|ERROR) " $$tmp; rm -f $$tmp; exit $$rc
