# fastckpt developer entry point. `make help` lists the targets.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := -c constraints.txt

.PHONY: help demo test install install-test rust-test py-test lint bench wheel clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

install: $(PY)  ## install fastckpt with the accelerate extra into $(VENV)
	$(PIP) install -q $(CONSTRAINTS) ".[accelerate]"

demo: install  ## install, then run `fastckpt demo` (GPT-2 small: train, save, reload, compare with accelerate)
	$(VENV)/bin/fastckpt demo

install-test: $(PY)  ## install fastckpt with the test dependencies into $(VENV)
	$(PIP) install -q $(CONSTRAINTS) ".[test]"

rust-test:  ## cargo tests of the Rust core and the object-store crate
	cargo test -p fastckpt-core --release
	cargo test -p fastckpt-store --release

py-test:  ## pytest suite (expects `make install-test` first)
	$(PY) -m pytest

test: install-test rust-test py-test  ## install, then run every test (cargo + pytest)

lint:  ## rustfmt, clippy, ruff, stubtest of _core.pyi
	cargo fmt --all --check
	cargo clippy --all-targets -- -D warnings
	$(PY) -m ruff check python tests benches
	$(PY) -m mypy.stubtest fastckpt._core  # _core.pyi matches the built module

bench: install-test  ## benchmark suite: every contender alternated, prints the table, writes benches/RESULTS.md
	$(PY) benches/run.py

wheel: $(PY)  ## build the abi3 wheel into dist/
	$(PY) -m pip install -q maturin
	$(VENV)/bin/maturin build --release -o dist

clean:  ## remove build outputs
	rm -rf target dist
