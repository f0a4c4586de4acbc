# Bastile. `make train` runs the main job, `make test` the tests; both set up what they need.
#
# Here (Rust toolchain, no GPU needed):  setup, build, test, train
# On a GPU machine with the built library (no Rust needed, system python with torch):
#   make gpu-test bench PY=python3 NO_BUILD=1
#   make bench-kernels | bench-e2e PART=1 | bench-profile  PY=python3 NO_BUILD=1 [ARGS='...']   (BENCHMARKS.md)
#   make bench-fsdp PY=python3 NO_BUILD=1          (Qwen3-1.7B under FSDP2 on every GPU)

VENV ?= .venv
PY ?= $(VENV)/bin/python
LIB := target/release/libbastile.so
export PYTHONPATH := $(CURDIR)/python_shim$(if $(PYTHONPATH),:$(PYTHONPATH))
export BASTILE_PYTHON := $(abspath $(PY))

# Versions the library is built and tested against (torch matches the GPU machine's build).
PINS := torch==2.11.0 transformers==5.17.0 'cuda-toolkit[nvcc,cccl]==13.0.2' nvidia-nvvm==13.0.88 \
        nvidia-cuda-crt==13.0.88 pytest==9.2.0 expecttest==0.3.0 numpy==2.4.6 accelerate==1.15.0 \
        peft==0.21.2

.PHONY: setup build test cargo-test pytest train gpu-test bench bench-kernels bench-e2e bench-profile bench-fsdp clean

# Project-local virtualenv with the pins, and libclang for bindgen.
setup: $(VENV)/.ready
$(VENV)/.ready:
	@ldconfig -p | grep -Eq 'libclang(-[0-9.]+)?\.so' || (apt-get update -qq && apt-get install -y -qq libclang-dev)
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(PINS)
	touch $@

ifeq ($(NO_BUILD),)
build: setup
	PATH=$(abspath $(VENV))/bin:$$PATH cargo build --release
else
build:
	@test -f $(LIB) || (echo "$(LIB) missing: build it on a machine with Rust (make build)"; exit 1)
endif

cargo-test: build
	PATH=$(abspath $(VENV))/bin:$$PATH cargo test --release

pytest: build
	$(PY) -m pytest tests -q -p no:cacheprovider

test: cargo-test pytest

train: build
	$(PY) benches/train_qwen3.py

# The ops: one cuda/<op>.cu each, with tests/test_<op>.py and benches/bench_<op>.py.
OPS := $(sort $(basename $(notdir $(wildcard cuda/*.cu))))

# GPU machine: the whole suite (CUDA tests included), then the ops' CUDA tests under compute-sanitizer
# (not the > 2^31-element ones nor the 32768x151936 peak-memory one, too slow there, nor torch.compile's,
# whose kernels are not ours).
SANITIZE ?= cuda and not int32 and not compile and not peak_memory
gpu-test: build
	$(PY) -m pytest tests -q -p no:cacheprovider
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_contract.py $(OPS:%=tests/test_%.py) -k "$(SANITIZE)"
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_lora.py -k "cuda and qwen3 and not moe"  # the LoRA nodes: one family is enough

# Every op against its peers (one script each).
OP_BENCHES := $(wildcard $(OPS:%=benches/bench_%.py))
bench: build
	set -e; for b in $(OP_BENCHES); do $(PY) $$b; done

# The suite (BENCHMARKS.md has the commands per 10-minute call); ARGS passes options, e.g. ARGS='--models 0.6B,1.7B'.
# Every op vs eager, torch.compile and Liger at Qwen3-0.6B/1.7B/4B/8B shapes: kernels.csv, kernels_<op>.png.
bench-kernels: build
	$(PY) benches/bench_kernels.py $(ARGS)

# Qwen3 fine-tuning in five modes, one process each; PART=n runs one piece of the matrix that fits 10 minutes.
bench-e2e: build
	$(PY) benches/bench_e2e.py $(if $(PART),--part $(PART)) $(ARGS)

# torch.profiler of one Bastile training step (ARGS='--mode hf' for HF's): kernels by CUDA time, by category.
bench-profile: build
	$(PY) benches/bench_profile.py $(ARGS)

# Qwen3-1.7B under FSDP2 on NPROC GPUs (default: all), HF then Bastile (one torchrun each), then both in
# one table; CSVs under $OUT or bench-results/. FSDP_ARGS adds options, e.g. "--seq 8192 --checkpointing".
NPROC ?= $(shell $(PY) -c 'import torch; print(torch.cuda.device_count())')
FSDP_ARGS ?=
bench-fsdp: build
	set -e; for m in hf bastile; do \
		$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) benches/bench_fsdp.py --mode $$m $(FSDP_ARGS); \
	done
	$(PY) benches/bench_fsdp.py --report $(FSDP_ARGS)

clean:
	cargo clean
