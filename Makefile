# idem: build, test and lint entry points (GNU make).
#
#   make test    services up, every test with -race, then CHAOS_SCALE=small make chaos (the test command)
#   make test-go services up, every test with -race, the allocation tests without (no chaos matrix)
#   make lint    gofmt, go vet, golangci-lint (installed on first use)
#   make chaos   the reliability matrix (CHAOS_SCALE=small|full, CHAOS_MULT, CHAOS_SEED, CHAOS_ONLY, CHAOS_PARALLEL)
#   make bench   the benchmark table: each path against its baseline (QUICK=1: smoke run)
#   make up      start or check PostgreSQL, Redis, RabbitMQ, MariaDB, NATS; install pgbouncer and Chromium (scripts/services.sh)
#   make down    stop what `make up` started with docker compose
#   make status  probe the services
#   make fmt     gofmt -s -w every Go file
#
# Variables: GOTESTFLAGS (extra go test flags, e.g. GOTESTFLAGS='-run TestX -v'),
# GOTEST_P (test binaries at a time, default 4), PKGS (default ./...),
# QUICK=1, ROUNDS (default 3), ONLY (a regexp of the rows' paths) and
# CPUPROFILE (a file for the CPU profile of the bench process) for make bench.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test
MAKEFLAGS += --no-print-directory

GO ?= go
PKGS ?= ./...
GOTESTFLAGS ?=
# Test binaries run at a time. Most of the tests wait on servers, child
# processes and timeouts rather than compute, so twice the cores of the
# 2-core machines the suite is timed on keeps both busy.
GOTEST_P ?= 4

GOLANGCI_LINT_VERSION := 2.15.0
# go install's target: the first GOPATH entry's bin (GOBIN is set explicitly
# so a user's own GOBIN does not move it).
TOOLS_BIN := $(firstword $(subst :, ,$(shell $(GO) env GOPATH)))/bin
GOLANGCI_LINT := $(TOOLS_BIN)/golangci-lint

# The packages that hold an allocation test (func Test...Allocations), for
# the test-go step that runs them without -race: with the default PKGS only
# those are built again, not every test binary.
ALLOC_TEST := ^func Test[A-Za-z0-9_]*Allocations[(]
ALLOC_PKGS = $(if $(filter ./...,$(PKGS)),$(or $(sort $(dir $(shell grep -rlE --include='*_test.go' --exclude-dir=.git --exclude-dir=testdata --exclude-dir=vendor '$(ALLOC_TEST)' . 2>/dev/null))),./...),$(PKGS))

# Every Go file but testdata fixtures and vendored code.
GOFILES = $(shell find . -name '*.go' -not -path './.git/*' -not -path '*/testdata/*' -not -path './vendor/*' 2>/dev/null)

.PHONY: help up down status test test-go lint fmt-check vet golangci-lint tools fmt bench chaos

help:
	@sed -n '3,16s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

up:
	@scripts/services.sh up

down:
	@scripts/services.sh down

status:
	@scripts/services.sh status

test: test-go
	@$(MAKE) chaos CHAOS_SCALE=small

test-go: up
	$(GO) test -race -count=1 -p $(GOTEST_P) -timeout 30m $(GOTESTFLAGS) $(PKGS)
	@# The allocation ceilings (Test*Allocations) again without the race
	@# detector, which makes sync.Pool drop items at random: some of them
	@# only build without it (//go:build !race).
	$(GO) test -count=1 -run 'Allocations$$' $(ALLOC_PKGS)

# The reliability matrix (test/chaos): built once, so the cells can
# re-execute the binary as the consumers they SIGKILL.
CHAOS_SCALE ?= full
chaos: up
	@bin=$$(mktemp -d)/chaos; trap 'rm -rf "$$(dirname $$bin)"' EXIT; \
	$(GO) build -o $$bin ./test/chaos/cmd/chaos && \
	CHAOS_SCALE=$(CHAOS_SCALE) $$bin

# All three checks run; lint fails at the end if any of them failed.
lint: tools
	@rc=0; \
	$(MAKE) fmt-check || rc=1; \
	$(MAKE) vet || rc=1; \
	$(MAKE) golangci-lint || rc=1; \
	if [ $$rc -ne 0 ]; then echo "lint: FAILED (see above)" >&2; fi; \
	exit $$rc

fmt-check:
	@files='$(GOFILES)'; [ -n "$$files" ] || exit 0; \
	out=$$(gofmt -l $$files); \
	if [ -n "$$out" ]; then \
		echo "gofmt: these files are not formatted (run: make fmt):" >&2; \
		echo "$$out" >&2; \
		exit 1; \
	fi; \
	echo "gofmt: ok"

vet:
	$(GO) vet $(PKGS)

golangci-lint: tools
	$(GOLANGCI_LINT) run $(PKGS)

# golangci-lint at exactly GOLANGCI_LINT_VERSION, built from the Go module
# proxy into $(TOOLS_BIN) when missing or of another version (built in a
# temporary directory, then moved over the old binary).
tools:
	@have=$$($(GOLANGCI_LINT) version --short 2>/dev/null || true); \
	if [ "$$have" != "$(GOLANGCI_LINT_VERSION)" ]; then \
		echo "installing golangci-lint v$(GOLANGCI_LINT_VERSION) into $(TOOLS_BIN)$${have:+ (found $$have)}"; \
		tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
		GOBIN="$$tmp" $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v$(GOLANGCI_LINT_VERSION); \
		mkdir -p '$(TOOLS_BIN)'; \
		mv -f "$$tmp/golangci-lint" '$(GOLANGCI_LINT)'; \
		$(GOLANGCI_LINT) version; \
	fi

fmt:
	@files='$(GOFILES)'; [ -z "$$files" ] || gofmt -s -w $$files

# The benchmark table of docs/BENCHMARKS.md (test/bench): every row against
# its baseline in alternating rounds, the SQL floors with pgbench, and the
# Redis rows' commands by hand. ONLY=REGEXP keeps the rows whose path matches.
bench:
	@scripts/bench.sh -rounds $(or $(ROUNDS),3) $(if $(QUICK),-quick) $(if $(ONLY),-only '$(ONLY)') $(if $(CPUPROFILE),-cpuprofile '$(CPUPROFILE)')
