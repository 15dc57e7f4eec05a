# leasehold — see README.md. `make test` is what .ci/run runs.
SHELL := /bin/bash
GO    ?= go
CONSUL := bin/consul
STATICCHECK := bin/staticcheck

.PHONY: all build test vet lint consul demo clean proto bench fuzz soak leasehold

# What `leasehold version` prints (and serve's start line, leasehold_build_info):
# the tag `git describe` finds and the commit, -dirty with local changes. Without
# a tag (or outside a checkout) they are empty and the binary falls back to what
# the Go toolchain recorded: its module version ("dev" in a checkout) and commit.
VERSION  ?= $(shell git describe --tags --dirty 2>/dev/null)
REVISION ?= $(shell r=$$(git rev-parse HEAD 2>/dev/null) && \
	{ git diff --quiet HEAD 2>/dev/null || r=$$r-dirty; echo $$r; })
LDFLAGS  := -X main.version=$(VERSION) -X main.revision=$(REVISION)
# grpcnotrace leaves out gRPC's golang.org/x/net/trace (grpc.EnableTracing's
# /debug/requests pages, which leasehold never turns on). It imports
# html/template, whose reflective method calls make the linker keep every
# exported method of every type it keeps: with it the binary is 45 MB, without
# it 30 MB, and an idle `leasehold serve` maps 7 MB less of it (BENCHMARKS.md,
# "The binary's own pages"). TestTheBinaryLinksOnlyTheMethodsItCalls holds it.
TAGS     := grpcnotrace

all: build

build: leasehold
	$(GO) build ./...

# bin/leasehold, knowing its version and commit.
leasehold:
	@mkdir -p bin
	$(GO) build -tags '$(TAGS)' -ldflags '$(LDFLAGS)' -o bin/leasehold ./cmd/leasehold

# Consul 1.13.9 built from the Go module proxy (tools/consul); only when missing.
consul: $(CONSUL)

$(CONSUL):
	@mkdir -p bin
	@echo "building $(CONSUL) from github.com/hashicorp/consul v1.13.9 (first time: ~5 min on 2 cores)"
	cd tools/consul && $(GO) build -o ../../$(CONSUL) github.com/hashicorp/consul

vet:
	$(GO) vet ./...

# staticcheck v0.8.2 built from the Go module proxy (tools/staticcheck); only when missing.
$(STATICCHECK):
	@mkdir -p bin
	cd tools/staticcheck && $(GO) build -o ../../$(STATICCHECK) honnef.co/go/tools/cmd/staticcheck

lint: $(STATICCHECK)
	$(GO) vet ./...
	$(STATICCHECK) ./...

# Fuzz targets, with their committed seed corpora (testdata/fuzz).
FUZZ := FuzzParseRegistration:./health FuzzNewDispatcher:./health FuzzDispatcherKey:./health FuzzTranslate:./snapshot/translator FuzzExecutorPrint:./snapshot/translator FuzzLeanListings:./adapters/consul
FUZZTIME ?= 3s

# Packages run one at a time (-p 1): the drills start real Consul agents,
# servers and executors with short real leases, and two packages' drills
# competing for 2 cores turned timings into flakes.
test: $(CONSUL) lint
	$(GO) test -race -count=1 -p 1 ./...
	@for f in $(FUZZ); do $(GO) test -run '^$$' -fuzz "^$${f%%:*}$$" -fuzztime $(FUZZTIME) $${f##*:} || exit 1; done

# Long drills (never part of make test): a 3-minute flap storm.
soak: $(CONSUL)
	LEASEHOLD_STORM=3m $(GO) test -race -count=1 -timeout 15m -run 'FlapStorm' -v ./cmd/leasehold

# A longer fuzzing run (never part of make test).
fuzz:
	@for f in $(FUZZ); do $(GO) test -run '^$$' -fuzz "^$${f%%:*}$$" -fuzztime 60s $${f##*:} || exit 1; done

clean:
	rm -rf bin

# The whole story on real parts: a Consul dev agent, leasehold serve, three
# gRPC executors and a dispatcher; DEMO_FLAGS=--keep leaves it running.
demo: $(CONSUL)
	@echo "building bin/leasehold, bin/executor, bin/dispatcher (first time: ~1 min)"
	$(GO) build -tags '$(TAGS)' -ldflags '$(LDFLAGS)' -o bin/leasehold ./cmd/leasehold
	$(GO) build -tags '$(TAGS)' -o bin/executor ./examples/executor
	$(GO) build -tags '$(TAGS)' -o bin/dispatcher ./examples/dispatcher
	$(GO) run ./examples/demo $(DEMO_FLAGS)

# Regenerate the committed Go code of proto/ and examples/workpb (needs protoc; the plugins are
# installed into bin/ at pinned versions).
PROTOC_GEN_GO      := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
PROTOC_GEN_GO_GRPC := google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
proto:
	@command -v protoc >/dev/null || { echo "protoc missing: apt-get install protobuf-compiler"; exit 1; }
	GOBIN=$(CURDIR)/bin $(GO) install $(PROTOC_GEN_GO)
	GOBIN=$(CURDIR)/bin $(GO) install $(PROTOC_GEN_GO_GRPC)
	PATH=$(CURDIR)/bin:$$PATH protoc -I proto --go_out=paths=source_relative:proto --go-grpc_out=paths=source_relative:proto proto/leasehold/v1/*.proto
	PATH=$(CURDIR)/bin:$$PATH protoc -I examples/workpb --go_out=paths=source_relative:examples/workpb --go-grpc_out=paths=source_relative:examples/workpb examples/workpb/work.proto

# Benchmarks (never part of make test): micro-benchmarks, then the end-to-end
# harness on real parts, which writes its table into BENCHMARKS.md.
bench: $(CONSUL)
	LEASEHOLD_MEASURE=1 $(GO) test -count=1 -run 'TestFrozenRemoteDatacenter' -v ./adapters/consul/consultest
	$(GO) test -run '^$$' -bench . -benchtime 1000x -count 4 ./adapters/otel
	$(GO) test -run '^$$' -bench . -count 3 ./snapshot/translator ./snapshot/xdscache ./snapshot/fleet
	$(GO) test -run '^$$' -bench CheckSessionBusyFleet -benchtime 1000x -count 3 ./adapters/consul
	$(GO) test -run '^$$' -bench FanOut -benchtime 200x -count 3 ./server
	$(GO) build -tags '$(TAGS)' -ldflags '$(LDFLAGS)' -o bin/leasehold ./cmd/leasehold
	$(GO) build -tags '$(TAGS)' -o bin/leasehold-bench ./cmd/leasehold-bench
	bin/leasehold-bench --leasehold bin/leasehold --delta --write BENCHMARKS.md
	bin/leasehold-bench --leasehold bin/leasehold --churn --executors 10000 --tasks 10 --agents 10 --lease 6s --heartbeat 2s --write BENCHMARKS.md
