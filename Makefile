# The two commands a newcomer needs (README.md):
#   make serve   run the service (cuda if present, else the cpu reference backend)
#   make test    run the whole test suite (kernels under the Triton interpreter when no GPU)
# and the quick check, a subset for a change in progress (under 90 s on a 2-core box):
#   make test-quick
PYTHON ?= python3
# Test processes without a GPU (pytest-xdist): the interpreter's kernel tests keep one core
# each busy, while service tests often wait on servers, so a third process fills those waits.
# A 2-core box, the whole suite: one process ~18 min, two 9.6, three 8.4 (2026-11-29); three
# 7.3-7.8 since tests/conftest.py spares the interpreter its redundant work (2026-12-01). With a
# GPU the suite runs in one process (its tests share the device).
TEST_WORKERS ?= 3
export PYTHONUNBUFFERED := 1

.PHONY: test test-quick serve lint proto bench

# No GPU: run the Triton kernels on the CPU through the interpreter, in TEST_WORKERS processes
# (worksteal: a worker that runs dry takes tests from the other's queue), each process (and the
# servers tests start) with one intra-op thread: the processes already share the cores, and
# torch's spinning pool threads only crowd them (2-core box: the paged-kernel and process-group
# files 86 -> 74 s; the whole suite 8:57 against 9:01-10:13 for the same tree without it).
# Our sources compiled once first: where PYTHONDONTWRITEBYTECODE is set (this dev box's image
# sets it) each of the suite's ~290 Python processes (servers, front ends, benchmark scripts)
# compiled every module of ours it imported (a server's imports: 3.5 -> 2.7 s of CPU, 2-core
# box, back to back; the compile itself ~1 s).
COMPILE_SOURCES = $(PYTHON) -m compileall -q -j 0 kernels service client tests tools benchmarks loadtest deploy >/dev/null
test:
	@$(COMPILE_SOURCES)
	@if $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PYTHON) -m pytest -q; \
	else \
		OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} TRITON_INTERPRET=1 \
			$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist worksteal; \
	fi

# A subset that still crosses every layer: the import layering, client units (requests,
# responses, wire codec, chunks, a fake server), service units (config, batching executor,
# validation), round trips through a real cpu server (service and client side), one small
# kernel test each for decode and prefill (under the interpreter without a GPU), and the
# README and deployment-file checks. `make test` (what .ci/run runs) stays the whole suite.
QUICK_TESTS := \
	tests/test_import_graph.py \
	tests/client/test_client_requests.py tests/client/test_client_responses.py \
	tests/client/test_client_wire.py tests/client/test_client_chunks.py \
	tests/client/test_client_fake.py tests/client/test_client_e2e.py \
	tests/service/test_service_config.py tests/service/engine/test_batch_units.py \
	tests/service/frontend/test_service_validation.py tests/service/test_service_roundtrip.py \
	tests/kernels/test_decode.py::test_gqa tests/kernels/test_prefill.py::test_gqa \
	tests/deploy/test_readme.py tests/deploy/test_compose.py tests/deploy/test_dockerfile.py

test-quick:
	@$(COMPILE_SOURCES)
	@if $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PYTHON) -m pytest -q $(QUICK_TESTS); \
	else \
		TRITON_INTERPRET=1 $(PYTHON) -m pytest -q $(QUICK_TESTS); \
	fi

serve:
	$(PYTHON) -m attention_service

lint:
	$(PYTHON) -m ruff check .


proto:
	$(PYTHON) proto/generate.py

bench:
	$(PYTHON) benchmarks/bench_kernels.py --out benchmarks/results/kernels
