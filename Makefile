# Each target sets up .venv (PyTorch 2.13.0 + this package) on first use, then runs.
PYTHON ?= python3
# Where pip finds torch: its own configuration by default (a CPU wheel on this project's machines). From
# PyPI, plain torch==2.13.0 is the CUDA build (several GB of CUDA packages); for the CPU one there,
# `make TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu demo`.
TORCH_INDEX ?=
# The datasets the presets and `neutreno reproduce` read (${NEUTRENO_DATA}/… in the configs).
export NEUTRENO_DATA ?= $(abspath ../shared/data)
VENV := .venv
BIN := $(VENV)/bin
SETUP := $(VENV)/.setup-done

.PHONY: demo test bench bench-gpu sweep-hf lint format clean

$(SETUP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_INDEX) torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(SETUP)
	$(BIN)/neutreno demo

# pytest over TEST_JOBS processes, one test file each at a time (its module fixtures built once), one
# thread each: most of the suite's time is `neutreno` processes starting and small single-threaded work
TEST_JOBS ?= 2

test: $(SETUP) lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

lint: $(SETUP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(SETUP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# timm, a baseline of bench/train_step.py, not a dependency (imported without torchvision)
TIMM := build/bench-timm

bench: $(SETUP)
	test -d $(TIMM)/timm || $(BIN)/python -m pip install -q --no-deps --target $(TIMM) timm==1.0.31 \
		|| echo "timm could not be installed: bench/train_step.py leaves out its timm rows"
	$(BIN)/python bench/attention_paths.py
	$(BIN)/python bench/train_step.py
	$(BIN)/python bench/analyze.py
	$(BIN)/python bench/data_pipeline.py
	$(BIN)/python bench/lm.py
	$(BIN)/python bench/hf_patch.py
	$(BIN)/python bench/host_bound.py
	$(BIN)/python bench/allocator.py
	$(BIN)/python bench/readme_tables.py

bench-gpu: $(SETUP)  # on a CUDA machine; --device cpu --quick runs its CPU parts
	$(BIN)/python bench/gpu.py

sweep-hf: $(SETUP)  # apply_neutreno and HFProbe over every transformers architecture (some minutes each)
	$(BIN)/python tools/hf_sweep.py --check patch --jobs 2 --out build/hf_sweep_patch.jsonl
	$(BIN)/python tools/hf_sweep.py --check probe --jobs 2 --out build/hf_sweep_probe.jsonl
	$(BIN)/python tools/hf_sweep.py --check static --jobs 2 --out build/hf_sweep_static.jsonl

clean:  # build files and the environment; runs/ (trainings, the demo's results) is kept
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
