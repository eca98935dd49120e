# budgetserve — the two commands a newcomer needs: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUNDLE := models/digits/manifest.json
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test bench bundle lint check-deploy schema grpc-stubs clean help

help:
	@echo "make serve   build the embedded digits bundle if missing, serve on $(HOST):$(PORT)"
	@echo "make test    run the test suite (starts a throwaway redis-server unless REDIS_URL is set)"
	@echo "make bench   run the benchmarks, results in docs/benchmarks/"
	@echo "make bundle  rebuild models/digits from scratch (profiling + training, a few minutes)"
	@echo "make lint    ruff (check + format --check) + mypy (incl. tests) + hadolint + check-deploy"
	@echo "make check-deploy  promtool checks and tests of deploy/prometheus, compose file validation"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 is required, found {sys.version.split()[0]}"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[train,dev]'
	@touch $(STAMP)

$(BUNDLE): | $(STAMP)
	$(BIN)/budgetserve-train build --out models/digits

serve: $(STAMP) $(BUNDLE)
	BUDGETSERVE_HOST=$(HOST) BUDGETSERVE_PORT=$(PORT) $(BIN)/budgetserve-serve

bundle: $(STAMP)
	$(BIN)/budgetserve-train build --out models/digits --force

test: $(STAMP) $(BUNDLE)
	scripts/ensure-prometheus.sh
	scripts/with-redis.sh $(BIN)/pytest -q $(PYTEST_ARGS)

bench: $(STAMP) $(BUNDLE)
	$(BIN)/python -m benchmarks

lint: $(STAMP) check-deploy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint docker/Dockerfile

check-deploy: $(STAMP)
	scripts/ensure-prometheus.sh
	$(BIN)/python scripts/check_deploy.py

# The gRPC messages (service/grpc_api/inference_pb2.py and .pyi) from their .proto; shipped,
# so that serving needs no protoc. tests/service/test_grpc.py checks they are up to date.
grpc-stubs: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. service/grpc_api/inference.proto

schema: $(STAMP)
	$(BIN)/python -m service.bundle > service/schema/manifest.schema.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
