# Every target sets itself up: a fresh clone needs only Python 3.11 and network access to PyPI.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: setup test test-bench test-slow test-netns test-engines test-ssh test-mpirun test-slurm engines demo bench bench-allreduce bench-allreduce-np4 \
        bench-allreduce-tcp bench-broadcast bench-allgather bench-fit bench-paths bench-faults bench-hvd bench-link docs clean \
        settings-table

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

setup: $(STAMP)

# The default suite: unit + multiprocess tests, no slow/soak/GPU/netns tests.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu and not netns and not bench and not engines" -n 2 --durations=25 tests

# Tests of the benchmark tooling (tfcs-bench, benchmarks/keras_throughput.py); a separate CI step.
test-bench: $(STAMP)
	$(BIN)/python -m pytest -m "bench and not slow and not gpu" -n 2 tests

# Slow and soak tests; CI runs them in a separate, time-bounded step.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow and not gpu" --durations=10 tests

# Multi-host tests: workers in network namespaces joined by veth pairs (needs root; skipped otherwise).
test-netns: $(STAMP)
	$(BIN)/python -m pytest -m "netns and not engines" tests/netns

# Real engines from Debian's packages (openssh-server, openmpi-bin, slurm-wlm + munge), installed when missing
# (root and apt-get needed; bounded in time). Tests whose engine is still missing skip, saying why.
engines:
	timeout 600 bash tests/engines/install.sh

# The engines' tests, one target (and one bounded CI step) per engine; `test-engines` runs them all.
test-ssh: $(STAMP) engines
	$(BIN)/python -m pytest -m "engines" tests/netns/test_ssh_launcher.py

test-mpirun: $(STAMP) engines
	$(BIN)/python -m pytest -m "engines" tests/engines/test_mpirun.py

test-slurm: $(STAMP) engines
	$(BIN)/python -m pytest -m "engines" tests/engines/test_slurm.py

test-engines: $(STAMP) engines
	$(BIN)/python -m pytest -m "engines" tests

demo: $(STAMP)
	$(BIN)/tfcs-run -np 2 $(BIN)/python examples/keras_mnist.py

# Every figure of docs/benchmarks.md: `make bench` runs them all (about 30 minutes on 2 cores; bench-faults needs root), each
# target one table; the JSON goes to bench-results/, the plots to docs/img/.
SIZES := 8,4K,256K,4M,64M,256M
BENCH := $(BIN)/tfcs-bench --interleave --rounds 4
bench: bench-allreduce bench-allreduce-np4 bench-allreduce-tcp bench-broadcast bench-allgather bench-fit bench-paths bench-hvd bench-faults bench-link

bench-allreduce: $(STAMP)
	$(BENCH) -np 2 --op allreduce --sizes $(SIZES) --compare tf-ring,gloo \
		--json bench-results/allreduce_np2.json --plot docs/img/allreduce.png

bench-allreduce-np4: $(STAMP)
	$(BENCH) -np 4 --op allreduce --sizes $(SIZES) --compare gloo --json bench-results/allreduce_np4.json

bench-allreduce-tcp: $(STAMP)
	$(BENCH) -np 2 --transport tcp --op allreduce --sizes $(SIZES) --compare gloo \
		--json bench-results/allreduce_tcp.json

bench-broadcast: $(STAMP)
	$(BENCH) -np 2 --op broadcast --sizes $(SIZES) --compare gloo --json bench-results/broadcast.json

bench-allgather: $(STAMP)
	$(BENCH) -np 2 --op allgather --sizes $(SIZES) --compare gloo --json bench-results/allgather.json

# The host backend's all-reduce paths turned off one at a time (docs/backends.md's table of paths).
bench-paths: $(STAMP)
	TFCS_SHM_CMA=0 $(BENCH) -np 2 --op allreduce --sizes $(SIZES) --compare gloo --json bench-results/paths_np2_no_cma.json
	TFCS_SHM_FUSION_BYTES=0 $(BENCH) -np 2 --op allreduce --sizes $(SIZES) --compare gloo \
		--json bench-results/paths_np2_no_buffers.json
	TFCS_SHM_FUSION_BYTES=0 TFCS_SMALL_ALLREDUCE_BYTES=0 $(BENCH) -np 2 --op allreduce --sizes $(SIZES) \
		--compare gloo --json bench-results/paths_np2_no_buffers_no_small.json
	TFCS_SHM_CMA=0 $(BENCH) -np 4 --op allreduce --sizes $(SIZES) --compare gloo --json bench-results/paths_np4_no_cma.json
	TFCS_SHM_CMA=0 TFCS_SHM_FUSION_BYTES=0 $(BENCH) -np 4 --op allreduce --sizes $(SIZES) --compare gloo \
		--json bench-results/paths_np4_ring_only.json
	TFCS_SHM_CMA=0 TFCS_SHM_FUSION_BYTES=0 $(BENCH) -np 4 --op allreduce --sizes 8,4K,256K,4M --compare gloo \
		--json bench-results/paths_np4_ring_small.json
	TFCS_SHM_CMA=0 TFCS_SHM_FUSION_BYTES=0 TFCS_SMALL_ALLREDUCE_BYTES=0 $(BENCH) -np 4 --op allreduce \
		--sizes 8,4K,256K,4M --compare gloo --json bench-results/paths_np4_ring_nosmall.json
	TFCS_NATIVE=0 $(BIN)/python benchmarks/keras_throughput.py --modes paired --rounds 2 --blocks 6 --steps 300 \
		--json bench-results/paths_fit_no_native.json

# Time from a fault (a cut link, a killed host) to each survivor's error, on namespace hosts joined by a
# 1 Gbit/s shaped link (needs root; about 5 minutes).
bench-faults: $(STAMP)
	$(BIN)/python benchmarks/fault_detection.py --trials 10 --rate 1gbit --json bench-results/faults.json

# All-reduce across 2 namespace hosts on a shaped link (1 and 10 Gbit/s), beside gloo in the same processes:
# the default data path, gRPC, and compression (needs root and torch; about 15 minutes).
bench-link: $(STAMP)
	$(BIN)/python benchmarks/link_allreduce.py --rate 1gbit --configs default,grpc,fp16,bf16 \
		--sizes 8,4K,256K,4M,64M,256M --json bench-results/link_1gbit.json
	$(BIN)/python benchmarks/link_allreduce.py --rate 10gbit --configs default,fp16 \
		--sizes 8,4K,256K,4M,64M,256M --json bench-results/link_10gbit.json

# A Horovod-style script (tf_commstrategy.horovod.DistributedOptimizer, no strategy) beside CommStrategy and the
# ceiling, in the same processes (tf_keras: DistributedOptimizer wraps tf_keras optimizers).
bench-hvd: $(STAMP)
	$(BIN)/python benchmarks/keras_throughput.py --keras 2 --modes paired --paired-jobs tfcs,ceiling,lockstep,hvd \
		--rounds 1 --blocks 8 --steps 300 --json bench-results/fit_hvd.json

bench-fit: $(STAMP)
	$(BIN)/python benchmarks/keras_throughput.py --modes paired,mwms --rounds 2 --blocks 6 --steps 300 \
		--json bench-results/fit.json --plot docs/img/keras_throughput.png

# The documentation site (MkDocs + Material, API reference from the docstrings) into site/.
# --strict: a broken link, a page missing from the nav or an unresolved reference fails the build.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# docs/usage.md's table of TFCS_* variables, from tf_commstrategy/config.py's SETTINGS (a test checks it).
settings-table: $(STAMP)
	$(BIN)/python -c 'import re, sys; from tf_commstrategy import config; p = "docs/usage.md"; s = open(p).read(); \
	s = re.sub(r"(<!-- settings-table: start.*?-->\n).*?(<!-- settings-table: end -->)", \
	lambda m: m.group(1) + config.settings_table() + m.group(2), s, flags=re.S); open(p, "w").write(s)'

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site
