# One-command setup, test and demo. The virtualenv lives outside the clone (a cache) so repeated
# runs do not download torch again; override with RAMTORCH_VENV=/path.
RAMTORCH_VENV ?= $(HOME)/.cache/ramtorch/venv
PY := $(RAMTORCH_VENV)/bin/python
# The torch that the tests run against (the GPU suite's). Another one: make test TORCH="torch==2.15.*"
TORCH ?= torch>=2.4,<2.12
# make demo STEPS=400 trains longer than the demo's default (under two minutes on two CPU cores).
STEPS ?=
ACT := VIRTUAL_ENV=$(RAMTORCH_VENV) PATH=$(RAMTORCH_VENV)/bin:$$PATH

.PHONY: setup build wheel test test-rust test-python lint demo bench-stage clean

setup: $(RAMTORCH_VENV)/.ramtorch-deps

$(RAMTORCH_VENV)/.ramtorch-deps: Makefile
	@command -v cargo >/dev/null || { echo "a Rust toolchain (cargo) is required: https://rustup.rs"; exit 1; }
	test -x $(PY) || python3 -m venv $(RAMTORCH_VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" numpy "hypothesis>=6" "pytest>=8" tqdm safetensors transformers accelerate peft torchao "ruff>=0.6" "maturin>=1.7,<2"
	touch $@

build: setup
	$(ACT) maturin develop --release -q

# A wheel (distribution ramtorch-rs, import name ramtorch) into dist/: one abi3 wheel for every
# CPython >= 3.10 on Linux x86-64 with glibc >= 2.28 (the manylinux_2_28 policy, torch's own),
# installable with pip and no Rust toolchain. zig (the ziglang package) links against glibc 2.28
# whatever the build machine's glibc is.
wheel: setup
	$(PY) -m pip install -q "ziglang>=0.13"
	$(ACT) maturin build --release --zig --compatibility manylinux_2_28 --out dist

test: build lint test-rust test-python

test-rust:
	cargo test --workspace --release
	cargo run --release -p ramtorch-core --example stream_and_adamw

test-python: build
	$(ACT) python -m pytest tests -q

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -q -- -D warnings
	$(ACT) ruff check python tests bench examples attacks
	$(ACT) ruff format --check python tests bench examples attacks

demo: build
	$(ACT) python examples/demo.py $(if $(STEPS),--steps $(STEPS))

clean:
	cargo clean

# The engine's Rust tests under AddressSanitizer (not part of `test`). Stable rustc accepts the
# -Z flag through RUSTC_BOOTSTRAP; the explicit --target keeps build scripts and proc macros
# unsanitized, the separate target dir keeps the normal build's artefacts; doctests cannot link
# under ASan, hence --lib --tests.
ASAN_TARGET ?= x86_64-unknown-linux-gnu
.PHONY: test-asan
test-asan:
	RUSTC_BOOTSTRAP=1 RUSTFLAGS=-Zsanitizer=address \
	CARGO_TARGET_DIR=target/asan ASAN_OPTIONS=detect_leaks=1 \
	cargo test -p ramtorch-core --release --lib --tests --target $(ASAN_TARGET)
