# overlayd — build, test, run. Kernel tests need root (they make their own
# network namespaces and remove them).
GO        ?= go
BIN       := bin/overlayd
FUZZTIME  ?= 20s
PKGS      := ./...

.PHONY: all build test unit fuzz lint bench run clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN) ./cmd/overlayd

# The whole suite, as CI runs it: lint, every package under the race
# detector, then the fuzz targets for a bounded time.
test: lint unit fuzz

unit:
	$(GO) test -race -count=1 -tags lockcheck $(PKGS)

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDB$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 1s ./peerdb

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) vet -tags lockcheck $(PKGS)

bench:
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 5x ./driver ./internal/nlbatch ./peerdb

# Serve the plugin on the default socket with the embedded defaults.
run: build
	./$(BIN)

clean:
	rm -rf bin
