# The two commands a newcomer needs (README.md):
#   make serve   run the service (cuda if present, else the cpu reference backend)
#   make test    run the whole test suite (kernels under the Triton interpreter when no GPU)
PYTHON ?= python3
export PYTHONUNBUFFERED := 1

.PHONY: test serve lint proto bench

# No GPU: run the Triton kernels on the CPU through the interpreter.
test:
	@if $(PYTHON) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PYTHON) -m pytest -q; \
	else \
		TRITON_INTERPRET=1 $(PYTHON) -m pytest -q; \
	fi

serve:
	$(PYTHON) -m attention_service

lint:
	$(PYTHON) -m ruff check .


proto:
	$(PYTHON) proto/generate.py

bench:
	$(PYTHON) benchmarks/bench_kernels.py
