package ipam

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// burst runs n concurrent RequestAddress calls (any address, distinct
// MACs) on every host at once and returns, per host, what they got and the
// errors.
func (c *cluster) burst(poolID string, n int) (got map[string][]netip.Prefix, errs map[string][]error) {
	got, errs = map[string][]netip.Prefix{}, map[string][]error{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	for hi, name := range c.names() {
		h := c.hosts[name]
		for i := range n {
			wg.Go(func() {
				<-start
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				a, err := h.request(ctx, poolID, "", mac(hi+1, i))
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs[name] = append(errs[name], err)
				} else {
					got[name] = append(got[name], a)
				}
			})
		}
	}
	close(start)
	wg.Wait()
	return got, errs
}

// Acceptance: three hosts, 300 concurrent RequestAddress calls each on one
// pool that fits them all: every call succeeds, 0 duplicates, every host
// got its 300, and the gateway is the same everywhere.
func TestThreeHostsConcurrentAllocation(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, name := range c.names() {
		poolID = c.hosts[name].requestPool(t, "127.77.0.0/20", "")
	}
	got, errs := c.burst(poolID, 300)
	for _, name := range c.names() {
		if len(errs[name]) > 0 {
			t.Fatalf("%s: %d requests failed, first: %v", name, len(errs[name]), errs[name][0])
		}
		if len(got[name]) != 300 {
			t.Fatalf("%s got %d addresses, want 300", name, len(got[name]))
		}
		for _, p := range got[name] {
			if p.Bits() != 20 {
				t.Fatalf("%s: %s lacks the pool's prefix length", name, p)
			}
		}
	}
	if total := c.checkNoDuplicates(poolID); total != 900 {
		t.Fatalf("%d addresses allocated, want 900", total)
	}
	var gws []string
	for _, name := range c.names() {
		gw, err := c.hosts[name].a.RequestAddress(ctxT(t), AddressRequest{PoolID: poolID, Options: map[string]string{OptionRequestAddressType: RequestAddressTypeGateway}})
		if err != nil {
			t.Fatal(err)
		}
		gws = append(gws, gw.String())
	}
	if gws[0] != "127.77.0.1/20" || gws[1] != gws[0] || gws[2] != gws[0] {
		t.Fatalf("gateways %v, want 127.77.0.1/20 on every host", gws)
	}
	c.converge(poolID)
	c.checkNoDuplicates(poolID)
}

// A /24 that runs out: 3×300 requests for 253 addresses. Each host first
// takes one address (so each owns space), then all ask at once: exactly
// 253 succeed, 0 duplicates, and every failure says the pool is full.
// Which host gets the rest depends on whose requests run first: a host
// gives its free space to whoever asks (donations), so one whose requests
// are scheduled last may have given it all away by then (always with
// GOMAXPROCS=1), and the burst is not asked to serve every host.
func TestThreeHostsExhaustPool(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, name := range c.names() {
		poolID = c.hosts[name].requestPool(t, "198.51.100.0/24", "")
	}
	for i, name := range c.names() {
		if _, err := c.hosts[name].request(ctxT(t), poolID, "", mac(10+i, 0)); err != nil {
			t.Fatalf("%s: first address: %v", name, err)
		}
	}
	got, errs := c.burst(poolID, 300)
	total := 3
	for _, name := range c.names() {
		total += len(got[name])
		for _, err := range errs[name] {
			wantErr(t, err, "pool "+poolID+" is full", "all 253 addresses are in use")
			wantReason(t, err, ReasonPoolFull)
		}
	}
	if total != 253 {
		t.Fatalf("%d addresses handed out, want all 253", total)
	}
	if n := c.checkNoDuplicates(poolID); n != 253 {
		t.Fatalf("%d distinct allocations, want 253", n)
	}
}

// Claims under contention: three hosts request a new pool and an address
// at once. Exactly one claim wins (one ring_created line in the cluster),
// everyone ends with the same ring and its addresses, 0 duplicates.
func TestClaimContention(t *testing.T) {
	for round := range 3 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			c := newCluster(t, "node-a", "node-b", "node-c")
			var wg sync.WaitGroup
			errs := make(chan error, 3)
			for i, name := range c.names() {
				h := c.hosts[name]
				wg.Go(func() {
					r, err := h.a.RequestPool(ctxT(t), PoolRequest{Pool: "203.0.113.0/24"})
					if err != nil {
						errs <- fmt.Errorf("%s: RequestPool: %w", name, err)
						return
					}
					if _, err := h.request(ctxT(t), r.PoolID, "", mac(i, 1)); err != nil {
						errs <- fmt.Errorf("%s: RequestAddress: %w", name, err)
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			created := 0
			for _, name := range c.names() {
				created += len(c.hosts[name].logs.Events(logkeys.IPAMRingCreated))
			}
			if created != 1 {
				t.Fatalf("%d hosts created the ring, want exactly 1", created)
			}
			const id = "overlayd:203.0.113.0/24"
			c.converge(id)
			if n := c.checkNoDuplicates(id); n != 3 {
				t.Fatalf("%d allocations, want 3", n)
			}
		})
	}
}

// A partition: node-c is cut off while both sides allocate. node-c uses
// its own space and then refuses, saying the owners of free space are
// unreachable; the majority side carries on. After healing, node-c gets
// space again. 0 duplicates at every quiet point.
// TestClaimErrorOfLastCompleteRound: a claim retried until its deadline
// reports why its last complete round failed, not the round the deadline
// cut short (whose voters had no time to answer: "no answer" for hosts
// that were unreachable all along). Each send blocks 1 s before failing
// and the request budget is 1.5 s, so the second round is always cut.
func TestClaimErrorOfLastCompleteRound(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	tm := testTiming
	tm.request, tm.vote, tm.backoff = 1500*time.Millisecond, 5*time.Second, time.Millisecond
	cc := c.startWith("node-c", newMemStore(), tm)
	c.net.partition("node-c", true)
	c.net.mu.Lock()
	c.net.slow = time.Second
	c.net.mu.Unlock()
	_, err := cc.a.RequestPool(ctxT(t), PoolRequest{Pool: "192.0.2.0/24"})
	wantErr(t, err, "could not create the address ring of pool overlayd:192.0.2.0/24", "a majority of the 3 hosts",
		"node-a: unreachable", "node-b: unreachable")
}

func TestPartition(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, name := range c.names() {
		poolID = c.hosts[name].requestPool(t, "198.51.100.0/24", "")
	}
	// Spread the space: each host takes a few addresses.
	for i, name := range c.names() {
		for j := range 5 {
			if _, err := c.hosts[name].request(ctxT(t), poolID, "", mac(20+i, j)); err != nil {
				t.Fatal(err)
			}
		}
	}
	c.converge(poolID)
	c.checkNoDuplicates(poolID)
	cc := c.hosts["node-c"]
	owned := cc.a.Status().Pools[0].LocalFree
	c.net.partition("node-c", true)

	got, errs := c.burst(poolID, 120)
	c.checkNoDuplicates(poolID)
	if uint64(len(got["node-c"])) != owned {
		t.Fatalf("node-c allocated %d addresses while cut off, want the %d free it owned", len(got["node-c"]), owned)
	}
	if len(errs["node-c"]) == 0 {
		t.Fatal("node-c never ran out while cut off")
	}
	for _, err := range errs["node-c"] {
		wantErr(t, err, "no free address in pool "+poolID, "node-a", "node-b", "unreachable (dead)")
	}
	if len(got["node-a"])+len(got["node-b"]) == 0 {
		t.Fatal("the majority side allocated nothing")
	}
	// A new pool cannot be created on the cut-off side (no majority),
	// and the error says so.
	_, err := cc.a.RequestPool(ctxT(t), PoolRequest{Pool: "192.0.2.0/24"})
	wantErr(t, err, "could not create the address ring of pool overlayd:192.0.2.0/24", "a majority of the 3 hosts", "node-a: unreachable")

	c.net.partition("node-c", false)
	c.converge(poolID)
	c.checkNoDuplicates(poolID)
	// Whatever is still free anywhere, node-c can now get a share.
	free := 0
	for _, name := range c.names() {
		free += int(c.hosts[name].a.Status().Pools[0].LocalFree)
	}
	if free > 0 {
		if _, err := cc.request(ctxT(t), poolID, "", mac(30, 0)); err != nil {
			t.Fatalf("node-c after healing: %v", err)
		}
	}
	c.checkNoDuplicates(poolID)
}

// A specific address (docker run --ip): given when free anywhere (its
// owner donates exactly that address), refused naming the host that holds
// it, and refused naming an owner that is unreachable.
func TestSpecificAddress(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	a, b := c.hosts["node-a"], c.hosts["node-b"]
	poolID := a.requestPool(t, "198.51.100.0/24", "")
	b.requestPool(t, "198.51.100.0/24", "")
	// node-a won the claim and owns everything: node-b asks for .7.
	if got, err := b.request(ctxT(t), poolID, "198.51.100.7", mac(2, 7)); err != nil || got.String() != "198.51.100.7/24" {
		t.Fatalf("node-b --ip 198.51.100.7: %v %v", got, err)
	}
	// Replay (same MAC): the same answer; another MAC: refused here.
	if _, err := b.request(ctxT(t), poolID, "198.51.100.7", mac(2, 7)); err != nil {
		t.Fatalf("replay: %v", err)
	}
	_, err := b.request(ctxT(t), poolID, "198.51.100.7", mac(2, 8))
	wantErr(t, err, "198.51.100.7 is in use on this host")
	// node-a cannot have it: node-b owns it now and holds it.
	_, err = a.request(ctxT(t), poolID, "198.51.100.7", mac(1, 7))
	wantErr(t, err, "198.51.100.7 is in use on node-b")
	wantReason(t, err, ReasonInUse)
	// node-a allocates .9; node-b asking for it hears who holds it.
	if _, err := a.request(ctxT(t), poolID, "198.51.100.9", mac(1, 9)); err != nil {
		t.Fatal(err)
	}
	_, err = b.request(ctxT(t), poolID, "198.51.100.9", mac(2, 9))
	wantErr(t, err, "198.51.100.9 is in use on node-a")
	// node-a gone: its addresses cannot be had.
	c.stop("node-a")
	_, err = b.request(ctxT(t), poolID, "198.51.100.20", mac(2, 20))
	wantErr(t, err, "198.51.100.20 is owned by node-a, which is unreachable (dead)")
	wantReason(t, err, ReasonOwnerUnreachable)
	c.checkNoDuplicates(poolID)
}

// Releases free the address for reuse; a release of an address that is not
// allocated here is an error naming it; the gateway's release is a no-op.
func TestRelease(t *testing.T) {
	c := newCluster(t, "node-a")
	a := c.hosts["node-a"]
	poolID := a.requestPool(t, "192.0.2.0/30", "")
	// A /30 has one address to hand out.
	got, err := a.request(ctxT(t), poolID, "", mac(1, 1))
	if err != nil || got.String() != "192.0.2.2/30" {
		t.Fatalf("only address: %v %v", got, err)
	}
	_, err = a.request(ctxT(t), poolID, "", mac(1, 2))
	wantErr(t, err, "is full")
	if err := a.a.ReleaseAddress(ctxT(t), poolID, "192.0.2.2"); err != nil {
		t.Fatal(err)
	}
	wantErr(t, a.a.ReleaseAddress(ctxT(t), poolID, "192.0.2.2"), "Address 192.0.2.2 is not allocated on this host")
	if err := a.a.ReleaseAddress(ctxT(t), poolID, "192.0.2.1"); err != nil {
		t.Fatalf("gateway release: %v", err)
	}
	if got, err := a.request(ctxT(t), poolID, "", mac(1, 2)); err != nil || got.String() != "192.0.2.2/30" {
		t.Fatalf("after release: %v %v", got, err)
	}
	if err := a.a.ReleasePool(ctxT(t), poolID); err != nil {
		t.Fatal(err)
	}
	wantErr(t, a.a.ReleasePool(ctxT(t), poolID), "PoolID "+poolID+" is not in use on this host")
}

// A host whose cluster has seeds but never joined does not claim alone.
func TestNotJoinedDoesNotClaim(t *testing.T) {
	net := newFakeNet()
	a, err := newAllocator(Config{NodeName: "node-a", Store: newMemStore(), Logger: slog.New(slog.DiscardHandler)}, testTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	_, err = a.RequestPool(ctxT(t), PoolRequest{Pool: "198.51.100.0/24"})
	wantErr(t, err, "cluster has not started yet")
	net.nodes["node-a"] = a
	a.SetTransport(&fakeTransport{net: net, name: "node-a", joined: false})
	_, err = a.RequestPool(ctxT(t), PoolRequest{Pool: "198.51.100.0/24"})
	wantErr(t, err, "has not joined its cluster yet", "waits to join")
	if st := a.Status(); len(st.Pools) != 1 || st.Pools[0].InUse != 0 || st.Pools[0].PendingClaim != "" {
		t.Fatalf("a refused RequestPool left state: %+v", st.Pools)
	}
}
