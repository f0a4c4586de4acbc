# Bastile. `make train` runs the main job, `make test` the tests; both set up what they need.
#
# Here (Rust toolchain, no GPU needed):  setup, build, wheel, install, test, train, test-latest
# On a GPU machine with the wheel built here in target/wheels (no Rust needed, system python with torch):
#   make gpu-test bench PY=python3 NO_BUILD=1
#   make bench-kernels | bench-e2e PART=1 | bench-families | bench-qlora | bench-sft | bench-profile  PY=python3 NO_BUILD=1 [ARGS='...']
#   make bench-fsdp PY=python3 NO_BUILD=1          (Qwen3-1.7B under FSDP2 on every GPU)
#   make bench-context PY=python3 NO_BUILD=1       (Llama-3-8B, Qwen3-8B LoRA, ring context parallelism, every GPU)

VENV ?= .venv
PY ?= $(VENV)/bin/python
WHEELS := target/wheels
export BASTILE_PYTHON := $(abspath $(PY))

# The transformers releases the patches are tested against, oldest and newest (python_shim/bastile/versions.py).
TRANSFORMERS_RANGE := $(shell python3 python_shim/bastile/versions.py)
OLDEST := $(word 1,$(TRANSFORMERS_RANGE))
NEWEST := $(word 2,$(TRANSFORMERS_RANGE))
# Versions the library is built and tested against (torch matches the GPU machine's build).
TOOLS := pytest==9.2.0 expecttest==0.3.0 numpy==2.4.6 accelerate==1.15.0 peft==0.21.2 trl==1.16.0 datasets==5.2.0 \
         bitsandbytes==0.50.2 deepspeed==0.19.8
PINS := torch==2.11.0 transformers==$(OLDEST) 'cuda-toolkit[nvcc,cccl]==13.0.2' nvidia-nvvm==13.0.88 \
        nvidia-cuda-crt==13.0.88 $(TOOLS)
# The newest releases (make test-latest): torch with the CUDA compiler of its CUDA release, the newest tested
# transformers.
LATEST := torch==2.15.0 'cuda-toolkit[nvcc,cccl]==13.2.2' transformers==$(NEWEST) $(TOOLS)

.PHONY: setup build wheel install test cargo-test pytest pytest-newest test-latest train gpu-test bench bench-kernels bench-e2e bench-families bench-qlora bench-sft bench-profile bench-fsdp bench-context clean

# Project-local virtualenv with the pins, and libclang for bindgen. The pins take ~5.5 GiB installed and
# pip's cache would keep a second copy of their wheels; a fresh CI disk has run out of space on that.
setup: $(VENV)/.ready
$(VENV)/.ready:
	@ldconfig -p | grep -Eq 'libclang(-[0-9.]+)?\.so' || (apt-get update -qq && apt-get install -y -qq libclang-dev)
	@df -h . $${TMPDIR:-/tmp} | sed 's/^/disk: /'
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir --upgrade pip
	$(VENV)/bin/pip install -q --no-cache-dir $(PINS)
	touch $@

# Tests, benchmarks and the main job import the installed package, as users do: a file the wheel lacks
# fails them. Here the wheel is built (pyproject.toml: cargo, then the package with libbastile.so inside)
# and installed into the virtualenv; with NO_BUILD (no Rust), a wheel built elsewhere and carried in
# target/wheels is installed into .site.
ifeq ($(NO_BUILD),)
build: setup
	PATH=$(abspath $(VENV))/bin:$$PATH cargo build --release

wheel: build
	rm -f $(WHEELS)/bastile-*.whl
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w $(WHEELS) .

install: wheel
	$(PY) -m pip install -q --no-deps --force-reinstall $(WHEELS)/bastile-*.whl
else
export PYTHONPATH := $(CURDIR)/.site$(if $(PYTHONPATH),:$(PYTHONPATH))
build wheel:
install:
	@ls $(WHEELS)/bastile-*.whl >/dev/null || (echo "no wheel in $(WHEELS): build it where Rust is (make wheel)"; exit 1)
	$(PY) -m pip install -q --no-deps --upgrade --target .site $(WHEELS)/bastile-*.whl
endif

cargo-test: build
	PATH=$(abspath $(VENV))/bin:$$PATH cargo test --release

PYTEST = $(PY) -m pytest tests -q -p no:cacheprovider
pytest: install
	$(PYTEST)

# The same build with the newest tested transformers in front of the pinned one, for the tests that its modeling
# code can change: all but the ops' own (OP_TESTS: each op against its reference, the registration contract, the
# library's packaging), which the first pass ran.
NEWEST_SITE := $(VENV)/transformers-$(NEWEST)
OP_TESTS = tests/test_contract.py tests/test_library.py tests/test_fused_linear_log_probs.py tests/test_expert_group.py \
	tests/test_expert_route_sigmoid.py $(OPS:%=tests/test_%.py)
$(NEWEST_SITE)/.ready: | setup
	$(PY) -m pip install -q --no-cache-dir --no-deps --target $(NEWEST_SITE) transformers==$(NEWEST)
	touch $@
PYTEST_NEWEST = PYTHONPATH=$(abspath $(NEWEST_SITE))$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PYTEST) $(OP_TESTS:%=--ignore=%)
pytest-newest: install $(NEWEST_SITE)/.ready
	$(PYTEST_NEWEST)

# The two passes side by side (the second's output follows the first's), one thread each: most tests are one
# thread of Python's time, and a CI machine has two cores. Two processes of two OpenMP threads on two cores ran
# test_experts.py in 276 s where one took 49 (waiting threads spin); two of one thread each took 48.
test: cargo-test install $(NEWEST_SITE)/.ready
	export OMP_NUM_THREADS=1; $(PYTEST_NEWEST) > target/pytest-newest.log 2>&1 & newest=$$!; \
	$(PYTEST); first=$$?; wait $$newest; second=$$?; \
	echo "--- transformers $(NEWEST):"; cat target/pytest-newest.log; exit $$((first || second))

# Bastile built from source against the newest torch and transformers (its own virtualenv and target
# directory), then cargo test and the suite: run before each release (README, "Versions").
LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
$(LATEST_VENV)/.ready:
	python3 -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/pip install -q --no-cache-dir --upgrade pip
	$(LATEST_VENV)/bin/pip install -q --no-cache-dir $(LATEST)
	touch $@
test-latest: $(LATEST_VENV)/.ready
	rm -rf target/latest/wheels
	export BASTILE_PYTHON=$(abspath $(LATEST_PY)) CARGO_TARGET_DIR=target/latest PATH=$(abspath $(LATEST_VENV))/bin:$$PATH; \
	set -e; cargo test --release; $(LATEST_PY) -m pip wheel -q --no-build-isolation --no-deps -w target/latest/wheels .
	$(LATEST_PY) -m pip install -q --no-deps --force-reinstall target/latest/wheels/bastile-*.whl
	$(LATEST_PY) -m pytest tests -q -p no:cacheprovider

train: install
	$(PY) benches/train_qwen3.py

# The ops: one cuda/<op>.cu each, with tests/test_<op>.py and benches/bench_<op>.py.
OPS := $(sort $(basename $(notdir $(wildcard cuda/*.cu))))

# GPU machine: the whole suite (CUDA tests included), then the ops' CUDA tests under compute-sanitizer
# (not the > 2^31-element ones nor the 32768x151936 peak-memory one, too slow there, nor torch.compile's,
# whose kernels are not ours).
# torch.profiler sees no kernel under compute-sanitizer: the kernel_choice tests run in the first pass only.
SANITIZE ?= cuda and not int32 and not compile and not peak_memory and not kernel_choice
gpu-test: install
	$(PY) -m pytest tests -q -p no:cacheprovider
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_contract.py $(OPS:%=tests/test_%.py) -k "$(SANITIZE)"
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) -m pytest -q -p no:cacheprovider \
		"tests/test_lora.py::test_training_matches_peft_cuda_bf16[qwen3]"  # the LoRA nodes: one family is enough

# Every op against its peers (one script each).
OP_BENCHES := $(wildcard $(OPS:%=benches/bench_%.py))
bench: install
	set -e; for b in $(OP_BENCHES); do $(PY) $$b; done

# The suite (BENCHMARKS.md has the commands per 10-minute call); ARGS passes options, e.g. ARGS='--models 0.6B,1.7B'.
# Every op vs eager, torch.compile and Liger at Qwen3-0.6B/1.7B/4B/8B shapes: kernels.csv, kernels_<op>.png.
bench-kernels: install
	$(PY) benches/bench_kernels.py $(ARGS)

# Qwen3 fine-tuning in five modes, one process each; PART=n runs one piece of the matrix that fits 10 minutes.
bench-e2e: install
	$(PY) benches/bench_e2e.py $(if $(PART),--part $(PART)) $(ARGS)

# The newer families (Mixtral, Phi-3/4, SmolLM3, Granite, Ministral 3, OLMo 2/3, GLM-4) at published configs:
# HF, Liger, Bastile (ARGS='--models phi3-mini,glm4-9b' for some).
bench-families: install
	$(PY) benches/bench_families.py $(ARGS)

# QLoRA (4-bit bitsandbytes bases, PEFT LoRA r16): HF, Liger, Bastile; and the dequantization kernel against
# bitsandbytes' (bitsandbytes and liger-kernel installed).
bench-qlora: install
	$(PY) benches/bench_qlora.py $(ARGS)

# TRL's SFTTrainer on packed mixed-length data: TRL, + Liger, + Bastile, Bastile's loader (trl, datasets and
# liger-kernel installed; ARGS='--padded' adds padded batches).
bench-sft: install
	$(PY) benches/bench_sft.py $(ARGS)

# torch.profiler of one Bastile training step (ARGS='--mode hf' for HF's): kernels by CUDA time, by category.
bench-profile: install
	$(PY) benches/bench_profile.py $(ARGS)

# Qwen3-1.7B under FSDP2 on NPROC GPUs (default: all), HF then Bastile (one torchrun each), then both in
# one table; CSVs under $OUT or bench-results/. FSDP_ARGS adds options, e.g. "--seq 8192 --checkpointing".
NPROC ?= $(shell $(PY) -c 'import torch; print(torch.cuda.device_count())')
FSDP_ARGS ?=
bench-fsdp: install
	set -e; for m in hf bastile; do \
		$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) benches/bench_fsdp.py --mode $$m $(FSDP_ARGS); \
	done
	$(PY) benches/bench_fsdp.py --report $(FSDP_ARGS)

# The longest context per GPU count: Llama-3-8B and Qwen3-8B LoRA under ring context parallelism over NPROC GPUs,
# HF then Bastile (one torchrun each), then one table; CONTEXT_ARGS adds options, e.g. "--contexts 65536,131072".
CONTEXT_ARGS ?=
bench-context: install
	set -e; for model in llama3-8b qwen3-8b; do for m in hf bastile; do \
		$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) benches/bench_context.py \
			--model $$model --mode $$m $(CONTEXT_ARGS); \
	done; done
	$(PY) benches/bench_context.py --report

clean:
	cargo clean
