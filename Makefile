# `make test` and `make demo` work on a fresh clone: they build .venv first.
PYTHON ?= python3
# The CPU build lying on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo bench gpu-check docs docs-check package-check clean

.PHONY: FORCE
# The torch spec the venv was built with, rewritten only when TORCH_SPEC differs from it, so that
# `make test TORCH_SPEC=torch==2.14.1` after a build with another spec installs that torch.
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

# torch goes in with the package, in one command, so the resolver cannot swap it for another.
$(VENV)/.installed: setup.cfg setup.py $(VENV)/.torch-spec
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e '.[test,demo,lightning]'
	touch $@

test: $(VENV)/.installed
	$(BIN)/python -m pytest tests

# MALLOC_MMAP_THRESHOLD_: freed tensors go back to the system, so measured peaks follow live bytes.
# demo_out/ is the demo's own output, made afresh: its checkpoints are never overwritten in place.
# The --invariant runs: the same global batches at 1 and at 2 ranks, each step's loss side by side.
INVARIANT := examples/train_gpt.py --invariant --micro-batches 4 --stage 2 --steps 4 --layers 2 --dim 64 --val-batches 1
demo: $(VENV)/.installed
	rm -rf demo_out
	MALLOC_MMAP_THRESHOLD_=65536 $(BIN)/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
	@for n in 1 2; do \
		$(BIN)/torchrun --standalone --nproc-per-node $$n $(INVARIANT) --out demo_out/invariant-$$n \
			> demo_out/invariant-$$n.out 2> demo_out/invariant-$$n.err || { tail -20 demo_out/invariant-$$n.err; exit 1; }; \
		awk '/^stage 2 step/ {print $$4, $$6}' demo_out/invariant-$$n.out > demo_out/invariant-$$n.txt; done
	@echo; echo "--invariant --micro-batches 4 (ZeRO-2): each step's loss at 1 rank and at 2 ranks"
	@paste -d' ' demo_out/invariant-1.txt demo_out/invariant-2.txt | awk '{printf "  step %s   %s   %s\n", $$1, $$2, $$4}'
	@cmp -s demo_out/invariant-1.txt demo_out/invariant-2.txt && echo "  the same to the last digit" || { echo "  they differ"; exit 1; }
	$(BIN)/python examples/fit_in_budget.py

# The `bench` extra (DeepSpeed) goes in with the torch pin, so the resolver cannot swap torch.
$(VENV)/.bench-installed: $(VENV)/.installed setup.cfg
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e '.[bench]'
	touch $@

# Several launches: all twenty implementations' 40M models at once need more memory than 24 GiB.
LAYERS_12 := ideal,ddp,torch_zero,fairscale,zero1,zero1_overlap,zero1_overlap_interleaved,zero2,zero2_overlap,zero2_static,zero2_fp16,zero2_compile,zero2_unused,ds_zero1,ds_zero2
LAYER_3 := ideal,ddp,fsdp2,fsdp2_no_reshard,fsdp1,zero3,zero3_grad_op,ds_zero3,fsdp2_compile,zero3_compile
# Muon over the blocks' matrices (10m only: Newton-Schulz in bf16 on the CPU is slow at 40m)
MUON := ddp_muon,zero2_muon,fsdp2_muon,zero3_muon
# The invariant mode (sharded.invariant.MicroBatches) against the usual accumulation, per stage, 8 micro-batches;
# turns of one step, since its table pairs each invariant step with its default row's step of the same round
ACCUMULATION := zero1_accum,zero1_invariant,zero2_accum,zero2_invariant,zero3_accum,zero3_accum_nosync,zero3_invariant
# Low-bit communication (issue 39): each stage's modes against the same stage exact and DDP, DeepSpeed ZeRO++ (hpZ: its
# quantised weights and gradients do not run on its CPU accelerator), the codecs' throughput, and the shadow check's cost
LOWBIT := ddp,zero1,zero1_int8,zero1_fp8,zero2,zero2_int8,zero2_int4,zero3,zero3_int8,zero3_int8_int4,zero3_fp8,ds_zero3,ds_zeropp_hpz
bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/bench.py --impls $(LAYERS_12) --zero-worlds '' --out bench_out/layers12
	$(BIN)/python benchmarks/bench.py --impls $(LAYER_3) --out bench_out/layer3
	$(BIN)/python benchmarks/bench.py --impls $(MUON) --sizes 10m --zero-worlds '' --out bench_out/muon
	$(BIN)/python benchmarks/bench.py --impls $(ACCUMULATION) --sizes 10m --micro-batches 8 --turn 1 --zero-worlds '' --out bench_out/invariant
	$(BIN)/python benchmarks/bench.py --impls $(LOWBIT) --sizes 10m,40m-short --zero-worlds '' --out bench_out/lowbit
	$(BIN)/python benchmarks/lowbit_kernels.py --out bench_out/lowbit_kernels
	$(BIN)/python benchmarks/lowbit_shadow.py --out bench_out/lowbit_shadow
	$(BIN)/python benchmarks/report.py bench_out/layers12/bench.json bench_out/layer3/bench.json bench_out/muon/bench.json \
		bench_out/invariant/bench.json bench_out/lowbit/bench.json bench_out/lowbit_kernels/lowbit_kernels.json > bench_out/tables.md

# What only a GPU can show; run it first on any machine lent with one. The device-agnostic tests
# on CUDA when torch sees a GPU, else on the CPU (the same code: CI runs every line), then
# benchmarks/gpu_check.py's world-1 checks; one report, gpu_out/report.md and report.json, which
# also holds the tests' outcome (pytest's own failure does not stop the report: its exit status does).
# A lent GPU machine has its own CUDA torch and no network: make gpu-check GPU_PYTHON=python3
# On the CPU these tests run in `make test` anyway: a subset keeps the command within 3 minutes.
GPU_PYTHON ?= $(BIN)/python
GPU_CHECK_TESTS := tests/test_device_suite.py tests/test_oss.py tests/test_sharded_ddp.py tests/test_grad_scaler.py \
	tests/test_fsdp.py tests/test_fsdp_features.py tests/test_checkpoint_resume.py
GPU_CHECK_CPU_TESTS := tests/test_device_suite.py tests/test_grad_scaler.py tests/test_fsdp.py
gpu-check: $(if $(filter $(BIN)/python,$(GPU_PYTHON)),$(VENV)/.installed)
	rm -rf gpu_out && mkdir -p gpu_out
	-device=$$($(GPU_PYTHON) -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")'); \
		tests="$(GPU_CHECK_TESTS)"; [ "$$device" = cuda ] || tests="$(GPU_CHECK_CPU_TESTS)"; \
		SHARDED_TEST_DEVICE=$$device $(GPU_PYTHON) -m pytest -p no:cacheprovider -q -rs --junitxml=gpu_out/device_tests.xml $$tests
	MALLOC_MMAP_THRESHOLD_=65536 $(GPU_PYTHON) benchmarks/gpu_check.py --out gpu_out --device-tests gpu_out/device_tests.xml

# The docs site (docs/, Sphinx + MyST): HTML in docs/_build/html, every warning an error (a
# broken cross-reference, a page left out of the navigation, a docstring that does not parse);
# then every internal link and anchor of the built site is followed (docs/check_site.py links).
$(VENV)/.docs-installed: $(VENV)/.installed setup.cfg
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	rm -rf docs/_build
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	$(BIN)/python docs/check_site.py links docs/_build/html

# The built site in a real browser (Debian's chromium, headless): the index, a guide and an API
# page render with their navigation, and the search page finds a public name; screenshots in
# docs/_build/screens. Needs `apt-get install chromium`.
docs-check: docs
	$(BIN)/python docs/check_site.py browser docs/_build/html --screens docs/_build/screens

# The package as a user gets it: an sdist and a wheel (python -m build), their metadata checked
# (twine check --strict), the wheel installed into a fresh venv holding only torch, and the three
# layers imported there, from outside the source tree.
PACKAGE_VENV := build/package-venv
$(VENV)/.package-installed: $(VENV)/.installed setup.cfg
	$(BIN)/pip install --quiet "$(TORCH_SPEC)" -e '.[package]'
	touch $@

package-check: $(VENV)/.package-installed
	rm -rf dist $(PACKAGE_VENV)
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(PYTHON) -m venv $(PACKAGE_VENV)
	$(PACKAGE_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" dist/*.whl
	cd / && $(CURDIR)/$(PACKAGE_VENV)/bin/python $(CURDIR)/tests/installed_package.py $(CURDIR)/dist

clean:
	rm -rf $(VENV) build dist docs/_build *.egg-info .pytest_cache
