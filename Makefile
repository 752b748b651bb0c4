.DEFAULT_GOAL := help
V ?= v

help: ## List the tasks
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

install: ## The system packages the tests drive, then the virtualenv with the test extra
	bash scripts/install-test-deps
	python3 -m venv $(V) && $(V)/bin/pip install -e '.[test]'

lint: ## ruff (lint and format check) and mypy
	$(V)/bin/ruff check . && $(V)/bin/mypy

test: ## Run the test suite (starts its own Postgres)
	$(V)/bin/pytest -n 3 --dist worksteal

check: lint test ## Everything CI runs

demo: ## Run the demo on the embedded Postgres
	$(V)/bin/worker demo

bench: ## Throughput and latency against bare procrastinate
	$(V)/bin/python -m bench.throughput

baselines: ## Every workload beside plain SQL, procrastinate, Absurd and Graphile Worker
	$(V)/bin/pip install -q -e '.[bench]'
	$(V)/bin/python -m bench.baselines

schema: ## Regenerate sql/schema.sql from the migrations
	$(V)/bin/python scripts/dump_schema.py

.PHONY: help install lint test check demo bench baselines schema
