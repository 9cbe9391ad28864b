# overlayd — build, test, run. Kernel tests need root (they make their own
# network namespaces and remove them).
GO        ?= go
BIN       := bin/overlayd
# The version `overlayd version` prints and the serving line logs: from git
# (the tag, commits since, the commit, -dirty for uncommitted changes).
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo unknown)
LDFLAGS   := -X github.com/overlayd/overlayd/internal/version.stamp=$(VERSION)
# Fuzz budgets are execution counts, not durations: a duration ends the run
# through a context deadline, which go test sometimes reports as a failure
# ("context deadline exceeded") while workers are shutting down.
FUZZ_DB     ?= 40000x
FUZZ_KEYED  ?= 40000x
FUZZ_DECODE ?= 100000x
FUZZ_ADVERT ?= 50000x
FUZZ_IPAM   ?= 50000x
FUZZ_DNS    ?= 100000x
FUZZ_NETSYNC ?= 50000x
# Test builds check the lock hierarchy (lockcheck) and carry the driver's
# trace for the stress harness (testhooks); faultinject adds deliberate bugs.
TAGS      := lockcheck testhooks
PKGS      := ./...
STATICCHECK_VERSION := v0.8.2
STATICCHECK := bin/staticcheck-$(STATICCHECK_VERSION)/staticcheck

# The real-engine suite (test/docker) runs once per engine: Docker 20.10
# (Debian 12's docker.io) with every other package in `unit`, then Docker
# 26.1 (Debian 13's docker.io, containerd and docker-cli, which the suite
# fetches with apt-get and unpacks into a cache directory) in `engine-26.1`,
# then Docker 28.5 (Debian unstable's docker.io, containerd 2, docker-cli
# and docker-compose, fetched the same way) in `engine-28.5`.
# OVERLAYD_TEST_ENGINE picks the engine; test/docker/engines_test.go.

.PHONY: all build test unit engine-26.1 engine-28.5 fuzz lint bench bench-peers bench-gossip bench-intree bench-dataplane run clean plugin install

# `make install`: the binary, the systemd unit and (if absent) its settings
# file. DESTDIR stages the files under another root (packaging, tests): then
# nothing is reloaded or enabled. UNITDIR defaults to systemd's directory for
# locally installed units of the PREFIX.
PREFIX    ?= /usr/local
BINDIR    ?= $(PREFIX)/bin
UNITDIR   ?= $(PREFIX)/lib/systemd/system
DEFAULTS  ?= /etc/default/overlayd

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/overlayd

# The whole suite, as CI runs it: lint, every package under the race
# detector, the real-engine suite on the second and third engines, then the fuzz
# targets for a bounded time.
test: lint unit engine-26.1 engine-28.5 fuzz

unit:
	OVERLAYD_TEST_ENGINE=20.10 $(GO) test -race -count=1 -timeout 30m -tags '$(TAGS)' $(PKGS)
	$(GO) test -race -count=1 -tags '$(TAGS) faultinject' -run '^TestFaultsAreCaught$$' ./test/stress

# Run in the package's directory (go test's local-directory mode), so that
# the engine and version it drives and the suite's duration are printed
# even when it passes.
engine-26.1:
	cd test/docker && OVERLAYD_TEST_ENGINE=26.1 $(GO) test -race -count=1 -timeout 30m -tags '$(TAGS)'

# Each real-engine run takes 8-10 minutes, near go test's default limit of
# 10: every run that includes test/docker gets 30.
engine-28.5:
	cd test/docker && OVERLAYD_TEST_ENGINE=28.5 $(GO) test -race -count=1 -timeout 30m -tags '$(TAGS)'

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDB$$' -fuzztime $(FUZZ_DB) -fuzzminimizetime 1s ./peerdb
	$(GO) test -run '^$$' -fuzz '^FuzzKeyed$$' -fuzztime $(FUZZ_KEYED) -fuzzminimizetime 1s ./peerdb
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZ_DECODE) -fuzzminimizetime 1s ./internal/cluster
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeAdvert$$' -fuzztime $(FUZZ_ADVERT) -fuzzminimizetime 1s ./encryption
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZ_IPAM) -fuzzminimizetime 1s ./internal/ipam
	$(GO) test -run '^$$' -fuzz '^FuzzServe$$' -fuzztime $(FUZZ_DNS) -fuzzminimizetime 1s ./internal/dnsserver
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZ_NETSYNC) -fuzzminimizetime 1s ./internal/netspec
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeMessage$$' -fuzztime $(FUZZ_NETSYNC) -fuzzminimizetime 1s ./internal/netsync

lint: $(STATICCHECK)
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@# Nothing built and nothing over 1 MB is tracked.
	$(GO) run ./test/lint/trackedfiles
	@# Kernel access only through nlwrap and netnsutil (docs/architecture.md).
	$(GO) test -count=1 ./test/lint/kernelaccess
	$(GO) vet $(PKGS)
	$(GO) vet -tags '$(TAGS)' $(PKGS)
	$(GO) vet -tags '$(TAGS) faultinject' ./test/stress ./driver
	@# staticcheck (its default checks, unused among them), on the same
	@# builds as vet. Exceptions: //lint:ignore at the line, with a reason,
	@# or a staticcheck.conf in the package that explains itself.
	$(STATICCHECK) $(PKGS)
	$(STATICCHECK) -tags '$(TAGS)' $(PKGS)
	$(STATICCHECK) -tags '$(TAGS) faultinject' ./test/stress ./driver

# staticcheck at a pinned version, installed into bin/ (ignored by git) the
# first time lint runs, so a clean clone needs nothing installed by hand.
# Its directory is named after the version: changing the version installs
# the new one.
$(STATICCHECK):
	GOBIN=$(CURDIR)/$(dir $(STATICCHECK)) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 5x ./driver ./internal/nlbatch ./internal/testutil/rawnl
	$(GO) test -run '^$$' -bench . -benchmem ./peerdb
	$(GO) test -run '^$$' -bench '^BenchmarkRecordsToKernel$$' -benchtime 5x ./internal/cluster
	$(GO) test -run '^$$' -tags testhooks -bench . -benchtime 20000x ./test/stress
	$(GO) test -run '^$$' -bench 'Local|Obtain' -benchtime 1000x ./internal/ipam
	$(GO) test -run '^$$' -bench 'Heap' -benchtime 3x ./internal/ipam

# Peer programming against the raw-netlink reference (rawnl), every size,
# IPv4 peers (BenchmarkPeers) and IPv6 ones (BenchmarkPeersIPv6), one
# record per call (BenchmarkPeersOneByOne) and one record per gossip
# message through the cluster into the kernel (BenchmarkRecordsToKernel),
# BENCH_COUNT runs of 5 interleaved rounds each, summarised as the median
# and range over the runs of every figure (add-ratio_to_raw, peers/s, ...).
BENCH_COUNT ?= 3
bench-peers:
	{ $(GO) test -run '^$$' -bench '^BenchmarkPeers(IPv6|OneByOne)?$$' -benchtime 5x -count $(BENCH_COUNT) ./driver; \
	  $(GO) test -run '^$$' -bench '^BenchmarkRecordsToKernel$$' -benchtime 5x -count $(BENCH_COUNT) ./internal/cluster; } | tee /dev/stderr | sh test/bench/summary.sh

# Gossip cost per change with and without interest (records only to the
# hosts of a network): members spread over worker processes on loopback,
# a network on all hosts and one on 5, GOSSIP_SIZES members.
GOSSIP_SIZES ?= 10,50
bench-gossip:
	OVERLAYD_BENCH_INTEREST=1 OVERLAYD_BENCH_SIZES=$(GOSSIP_SIZES) $(GO) test -count=1 -timeout 60m -run '^TestBenchInterest$$' -v ./internal/cluster

# Join and Leave side by side with Docker's in-tree overlay driver (moby's,
# built in bench/intree, a module of its own): interleaved rounds, ratios.
bench-intree:
	sh bench/intree/compare.sh

# The data plane (docs/performance.md): TCP throughput (iperf3, 1 and 4
# streams) and 1-byte request/response between two namespace hosts joined by
# one veth, over the veth itself, a hand-made VXLAN link and overlayd's path
# (a container on each host), DP_ROUNDS interleaved rounds of DP_SECONDS per
# measurement, over an IPv4 and an IPv6 underlay (DP_FAMILIES); prints every
# round and the medians, ranges and ratios. Needs root; installs Debian's
# iperf3 if it is missing. Not part of make test (TestBenchDataplane skips
# without OVERLAYD_BENCH_DATAPLANE). It runs at nice DP_NICE so that other
# processes of a shared machine disturb it less (the kernel's work for them
# still does: compare the ratios of each round).
DP_ROUNDS   ?= 3
DP_SECONDS  ?= 5
DP_FAMILIES ?= 4,6
DP_NICE     ?= -20
bench-dataplane:
	@command -v iperf3 >/dev/null || { apt-get -o DPkg::Lock::Timeout=300 update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends iperf3; }
	OVERLAYD_BENCH_DATAPLANE=1 OVERLAYD_BENCH_ROUNDS=$(DP_ROUNDS) OVERLAYD_BENCH_SECONDS=$(DP_SECONDS) OVERLAYD_BENCH_FAMILIES=$(DP_FAMILIES) \
	  nice -n $(DP_NICE) $(GO) test -count=1 -timeout 60m -run '^TestBenchDataplane$$' -v ./driver

# Serve the plugin on the default socket with the embedded defaults.
run: build
	./$(BIN)

# The managed (v2) plugin: plugin/build/config.json + rootfs/ (static binary).
# Install it with `docker plugin create overlayd:latest plugin/build`.
plugin: build
	sh plugin/mkplugin.sh plugin/build $(BIN)

install: build
	install -D -m 0755 $(BIN) $(DESTDIR)$(BINDIR)/overlayd
	install -d $(DESTDIR)$(UNITDIR)
	sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@DEFAULTS@|$(DEFAULTS)|g' packaging/systemd/overlayd.service.in > $(DESTDIR)$(UNITDIR)/overlayd.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/overlayd.service
	@# The settings file is the operator's: never overwritten.
	if [ ! -e $(DESTDIR)$(DEFAULTS) ]; then install -D -m 0644 packaging/systemd/overlayd.default $(DESTDIR)$(DEFAULTS); fi
	@# Only a live system (no DESTDIR) running systemd learns of the unit.
	if [ -z '$(DESTDIR)' ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

clean:
	rm -rf bin
