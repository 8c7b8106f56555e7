# spotcr: `make demo` and `make test` install what they need (venv, pinned packages, CDK CLI, CRIU).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTHON_DIRS := functions vm-bootstrap infra rehearsal bench cli tests
export PYTHONPATH := $(CURDIR)/functions:$(CURDIR)/vm-bootstrap:$(CURDIR)/cli:$(CURDIR)
export CDK_DISABLE_CLI_TELEMETRY := 1
export CDK_DISABLE_VERSION_CHECK := 1
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
CDK := npx --no-install cdk --no-notices

.PHONY: where setup criu artifacts workload-deps tracked-deps lint test test-gpu nvidia-gpu demo bench synth deploy destroy lock clean

setup: $(VENV)/.installed $(VENV)/bin/spotcr node_modules/.installed criu artifacts

$(VENV)/.installed: requirements/dev.lock
	@command -v $(PYTHON) >/dev/null || { apt-get update -qq && apt-get install -y -qq python3 python3-venv; }
	@$(PYTHON) -m venv --help >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq python3-venv; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q uv==0.13.8
	$(VENV)/bin/uv pip sync -q --python $(PY) requirements/dev.lock
	touch $@

# The `spotcr` command ([project.scripts]), editable: it runs this checkout's code; its dependencies are in dev.lock.
$(VENV)/bin/spotcr: $(VENV)/.installed pyproject.toml
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps -e .
	@test -x $@ && touch $@

node_modules/.installed: package-lock.json
	@command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm; }
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

criu:
	@bash vm-bootstrap/install-criu.sh

# The workload suite's programs (tests/workloads): redis-server, MPICH, a JDK, Go, Node, gcc with OpenMP.
workload-deps:
	@bash tests/workloads/install-deps.sh

# The memory-tracking test VM (tests/tracked): QEMU, busybox, and Debian 12's own kernel, cached in ~/.cache/spotcr.
tracked-deps:
	@bash tests/tracked/install-deps.sh

# What job VMs (and the rehearsal's VMs) install instead of compiling: CRIU with its libraries, the agent's
# Python packages, the locked Debian packages a VM installs instead of apt, and amazon-efs-utils; built once into .build/ for this
# machine's architecture (arm64: run it on an arm64 machine).
artifacts: $(VENV)/.installed
	@PYTHON=$(PY) bash vm-bootstrap/build-artifact.sh
	@bash vm-bootstrap/fetch-debian-packages.sh
	@bash vm-bootstrap/fetch-efs-utils.sh

# Local runs mount no EFS: their asset carries the stand-in of mount.efs (no GitHub needed); synth and deploy fetch
# the real one, and fail if they cannot.
test test-gpu demo bench: export SPOTCR_EFS_UTILS := stand-in

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(PYTHON_DIRS)
	$(VENV)/bin/ruff format --check $(PYTHON_DIRS)
	$(VENV)/bin/mypy $(PYTHON_DIRS)

# Local VMs mount an empty tmpfs on these (as a fresh EC2 VM has): a checkout there would vanish inside them.
where:
	@case "$(CURDIR)/" in /tmp/* | /var/tmp/* | /dev/shm/*) echo "spotcr: the checkout $(CURDIR) is under /tmp, /var/tmp or /dev/shm, which every local VM replaces with an empty tmpfs; clone it elsewhere (e.g. under \$$HOME)" >&2; exit 2;; esac

# Two lanes side by side, one pytest process at a time in each: the tests marked `vms` (local VMs, CRIU, timed
# notices) but those in VMS_LATER; and every other test, then the `vms` tests in VMS_LATER, so both cores stay busy
# once the tests without VMs are done. Each lists its slowest tests; the other lane's reports follow the first's.
VMS_LATER := tests/cli tests/rehearsal
test: where setup workload-deps tracked-deps lint
	@{ $(PY) -m pytest -m "not vms and not gpu" --durations=15 > .build/pytest-others.log 2>&1; others=$$?; \
	  $(PY) -m pytest -m "vms and not gpu" --durations=15 $(VMS_LATER) > .build/pytest-vms-later.log 2>&1; \
	  later=$$?; test $$others -eq 0 && test $$later -eq 0; } & lane=$$!; \
	$(PY) -m pytest -m "vms and not gpu" --durations=40 $(addprefix --ignore=,$(VMS_LATER)); vms=$$?; \
	wait $$lane; lane=$$?; \
	echo "== the tests without VMs (.build/pytest-others.log) =="; cat .build/pytest-others.log; \
	echo "== the tests with VMs in $(VMS_LATER), after those (.build/pytest-vms-later.log) =="; \
	cat .build/pytest-vms-later.log; \
	test $$vms -eq 0 && test $$lane -eq 0

# A real CUDA job through the agent's checkpoint and restore (CRIU's CUDA plugin); not part of `make test`.
# Refuses, failing, on a machine without an NVIDIA GPU. Figures: bench/results/gpu_test.json.
test-gpu: where nvidia-gpu setup
	$(PY) -m pytest -m gpu tests/agent/test_gpu_criu.py

nvidia-gpu:
	@[ -n "$$(ls /proc/driver/nvidia/gpus 2>/dev/null)" ] || { echo "spotcr: no NVIDIA GPU on this machine (no /proc/driver/nvidia/gpus): make test-gpu and make bench ARGS=gpu need one; make test covers the GPU-independent parts" >&2; exit 2; }

# make exits 2 for any failed recipe, so the rehearsal's own exit code (README: 0, 1, 2) is printed as the last line.
demo: where setup
	@$(PY) -m rehearsal $(ARGS) || { code=$$?; echo "make demo: the rehearsal exited with $$code (1: the results differ, 2: it could not complete)" >&2; exit $$code; }

# MinIO for the S3 figures: built once from the Go module proxy unless one is named or on PATH.
bench: setup
	@[ -n "$${SPOTCR_BENCH_MINIO:-}" ] || command -v minio >/dev/null || bench/install-minio.sh \
		|| echo "make bench: no MinIO: the S3 figures come from moto's server, labelled as a mock" >&2
	$(PY) -m bench $(ARGS)

synth: $(VENV)/.installed node_modules/.installed artifacts
	$(CDK) synth --quiet $(ARGS)

deploy: $(VENV)/.installed node_modules/.installed artifacts
	$(CDK) deploy $(ARGS)

destroy: $(VENV)/.installed node_modules/.installed artifacts
	$(CDK) destroy $(ARGS)

lock: $(VENV)/.installed
	cd requirements && ../$(VENV)/bin/uv pip compile -q --python ../$(PY) dev.in -o dev.lock

clean:
	rm -rf $(VENV) node_modules cdk.out .mypy_cache .ruff_cache .pytest_cache .build
