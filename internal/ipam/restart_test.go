package ipam

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/statefile"
)

// Restart on the real state file: nothing lost, nothing freed. Replays of
// the requests dockerd made succeed with the same answers; new requests
// never get an address in use.
func TestRestartKeepsEverything(t *testing.T) {
	dir := t.TempDir()
	sf, err := statefile.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	c := newCluster(t)
	h := c.start("node-a", sf)
	poolID := h.requestPool(t, "198.51.100.0/24", "")
	before := map[string]netip.Prefix{}
	for i := range 40 {
		got, err := h.request(ctxT(t), poolID, "", mac(1, i))
		if err != nil {
			t.Fatal(err)
		}
		before[mac(1, i)] = got
	}
	for i := range 5 {
		if err := h.a.ReleaseAddress(ctxT(t), poolID, before[mac(1, i)].Addr().String()); err != nil {
			t.Fatal(err)
		}
		delete(before, mac(1, i))
	}
	id := h.a.Status().HostID
	h.a.Close()
	sf.Close()

	sf, err = statefile.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer sf.Close()
	h = c.start("node-a", sf)
	st := h.a.Status()
	if st.HostID != id {
		t.Fatalf("host id changed across a restart: %s → %s", id, st.HostID)
	}
	if len(st.Pools) != 1 || st.Pools[0].LocalUsed != 35 || st.Pools[0].InUse != 1 {
		t.Fatalf("after restart: %+v", st.Pools)
	}
	for m, want := range before {
		got, err := h.request(ctxT(t), poolID, want.Addr().String(), m)
		if err != nil || got != want {
			t.Fatalf("replay of %s for %s: %v %v", want, m, got, err)
		}
	}
	_, err = h.request(ctxT(t), poolID, before[mac(1, 10)].Addr().String(), mac(2, 10))
	wantErr(t, err, "is in use on this host")
	inUse := map[netip.Prefix]bool{}
	for _, p := range before {
		inUse[p] = true
	}
	for i := range 100 {
		got, err := h.request(ctxT(t), poolID, "", mac(3, i))
		if err != nil {
			t.Fatal(err)
		}
		if inUse[got] {
			t.Fatalf("%s handed out again after a restart", got)
		}
		inUse[got] = true
	}
	if err := h.a.ReleasePool(ctxT(t), poolID); err != nil {
		t.Fatalf("the pool's use count was lost: %v", err)
	}
}

// A crash (no Close) loses nothing that was answered: the store as it is
// when the answers have been given is enough to restart from.
func TestCrashLosesNothingAnswered(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	a := c.hosts["node-a"]
	poolID := a.requestPool(t, "198.51.100.0/24", "")
	c.hosts["node-b"].requestPool(t, "198.51.100.0/24", "")
	var mu sync.Mutex
	answered := map[netip.Prefix]string{}
	var wg sync.WaitGroup
	for i := range 60 {
		wg.Go(func() {
			got, err := a.request(ctxT(t), poolID, "", mac(1, i))
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			answered[got] = mac(1, i)
			mu.Unlock()
		})
	}
	wg.Wait()
	// The "crash": the store's content now, while the allocator runs on.
	crashed := newMemStore()
	crashed.data = snapshot(a.store.(*memStore))
	c.remove("node-a")
	a2 := c.start("node-a", crashed)
	for p, m := range answered {
		got, err := a2.request(ctxT(t), poolID, p.Addr().String(), m)
		if err != nil || got != p {
			t.Fatalf("after the crash, %s of %s: %v %v", p, m, got, err)
		}
	}
	if n := len(a2.allocations(poolID)); n != len(answered) {
		t.Fatalf("%d allocations after the crash, %d answered", n, len(answered))
	}
	c.checkNoDuplicates(poolID)
}

// A reinstalled host (empty state directory) is a new identity: it does
// not inherit its earlier installation's ranges, and no address of those
// ranges is handed out until they are reclaimed.
func TestNewIdentityNeverReuses(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, n := range c.names() {
		poolID = c.hosts[n].requestPool(t, "198.51.100.0/24", "")
	}
	for i, n := range c.names() {
		for j := range 10 {
			if _, err := c.hosts[n].request(ctxT(t), poolID, "", mac(i, j)); err != nil {
				t.Fatal(err)
			}
		}
	}
	c.converge(poolID)
	old := c.hosts["node-c"]
	oldID := old.a.self
	oldAllocs := old.allocations(poolID)
	p := old.a.lookupPool(poolID)
	p.mu.Lock()
	oldSpans := p.ring.owned(oldID)
	p.mu.Unlock()
	if len(oldSpans) == 0 {
		t.Fatal("node-c owned nothing")
	}
	c.remove("node-c")
	nc := c.start("node-c", newMemStore())
	if nc.a.self == oldID || nc.a.self.Name != oldID.Name {
		t.Fatalf("reinstalled identity %s, old %s", nc.a.self, oldID)
	}
	nc.requestPool(t, "198.51.100.0/24", "")
	inOld := func(x uint32) bool {
		for _, sp := range oldSpans {
			if x >= sp.first && x <= sp.last {
				return true
			}
		}
		return false
	}
	// Everything free outside the old identity's ranges gets used; the
	// old ranges stay untouched, and the refusals name their owner.
	c.burst(poolID, 200)
	for _, n := range c.names() {
		for _, x := range c.hosts[n].allocations(poolID) {
			if inOld(x) {
				t.Fatalf("%s allocated %s, in the range of node-c's earlier installation", n, addrOf(x))
			}
			if n == "node-c" && slices.Contains(oldAllocs, x) {
				t.Fatalf("the new node-c reuses %s", addrOf(x))
			}
		}
	}
	_, err := nc.request(ctxT(t), poolID, "", mac(9, 9))
	wantErr(t, err, "an earlier installation of node-c", "overlayd ipam reclaim node-c")
	c.checkNoDuplicates(poolID)
	// Reclaiming the old installation is allowed while the new one runs.
	res, err := c.hosts["node-a"].a.Reclaim(ctxT(t), "node-c")
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Identities) != 1 || res.Identities[0] != oldID.hexID() {
		t.Fatalf("reclaimed %v, want only the old identity %s", res.Identities, oldID.hexID())
	}
	if got, err := nc.request(ctxT(t), poolID, "", mac(9, 9)); err != nil {
		t.Fatalf("after the reclaim: %v", err)
	} else if !inOld(u32(got.Addr())) {
		t.Fatalf("after the reclaim node-c got %s, outside the reclaimed space, which should be all that is free", got)
	}
	c.checkNoDuplicates(poolID)
}

// Reclaim: refused while the node is alive; afterwards its space is the
// reclaimer's and usable, and the old host, if it ever comes back, learns
// it was reclaimed and refuses everything.
func TestReclaim(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, n := range c.names() {
		poolID = c.hosts[n].requestPool(t, "198.51.100.0/24", "")
	}
	for i, n := range c.names() {
		if _, err := c.hosts[n].request(ctxT(t), poolID, "", mac(i, 0)); err != nil {
			t.Fatal(err)
		}
	}
	c.converge(poolID)
	a := c.hosts["node-a"]
	_, err := a.a.Reclaim(ctxT(t), "node-c")
	wantErr(t, err, "node node-c is alive", "gone for good")
	_, err = a.a.Reclaim(ctxT(t), "node-a")
	wantErr(t, err, `node "node-a" is this host`)
	_, err = a.a.Reclaim(ctxT(t), "node-x")
	wantErr(t, err, "node node-x owns no address space")

	cStore := c.hosts["node-c"].store
	cID := c.hosts["node-c"].a.self
	c.stop("node-c")
	cSpans := func(h *host) []span {
		p := h.a.lookupPool(poolID)
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.ring.owned(cID)
	}(a)
	res, err := a.a.Reclaim(ctxT(t), "node-c")
	if err != nil {
		t.Fatal(err)
	}
	var moved uint64
	for _, sp := range cSpans {
		moved += sp.size()
	}
	if len(res.Pools) != 1 || res.Pools[0].Addresses != moved || res.Node != "node-c" {
		t.Fatalf("reclaim result %+v, want %d addresses of %s", res, moved, poolID)
	}
	a.logs.One(t, slog.LevelInfo, logkeys.IPAMReclaimed, []string{logkeys.Pool, poolID, logkeys.Member, "node-c"}, logkeys.HostID, logkeys.Count)
	// The reclaimed space is usable: node-a hands out its first address.
	first := addrOf(cSpans[0].first).String()
	if got, err := a.request(ctxT(t), poolID, first, mac(7, 7)); err != nil || got.Addr().String() != first {
		t.Fatalf("reclaimed %s: %v %v", first, got, err)
	}
	// node-b learns the new owner.
	waitUntil(t, 5e9, "node-b learns of the reclaim", func() bool {
		p := c.hosts["node-b"].a.lookupPool(poolID)
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.ring.ownedSize(cID) == 0
	})
	// The old node-c comes back: it learns it was reclaimed and refuses.
	old := c.start("node-c", cStore)
	waitUntil(t, 5e9, "the old node-c learns it was reclaimed", func() bool {
		_, err := old.request(ctxT(t), poolID, "", mac(8, 8))
		return err != nil && strings.Contains(err.Error(), "was reclaimed by node-a")
	})
	old.logs.One(t, slog.LevelError, logkeys.IPAMIdentityReclaimed, []string{logkeys.Member, "node-a"})
	c.checkNoDuplicatesExcept(poolID, "node-c")
	// Its messages are ignored: node-b's view keeps node-a as owner.
	p := c.hosts["node-b"].a.lookupPool(poolID)
	p.mu.Lock()
	owner := p.ring.ownerOf(cSpans[0].first)
	p.mu.Unlock()
	if owner != a.a.self {
		t.Fatalf("after the old host returned, node-b says %s owns %s", owner, first)
	}
}

// TestReclaimEndsWaitingRequest: a request waiting for other hosts'
// answers ends with the reclaim's error as soon as this host learns that
// its space was reclaimed, not when its wait runs out (the others drop a
// reclaimed identity's messages: no answer is coming). node-b's message
// is lost and the answer would be waited for 30 s; the reclaim arrives
// meanwhile. address: node-b asks node-a for an address node-a owns.
// pool: node-b claims a new pool's ring and waits for node-a's vote.
func TestReclaimEndsWaitingRequest(t *testing.T) {
	patient := testTiming
	patient.donate, patient.vote, patient.request = 30*time.Second, 30*time.Second, time.Minute
	for _, tc := range []struct {
		name string
		lost msgKind
		call func(ctx context.Context, c *cluster, poolID string) error
	}{
		{"address", kindDonateReq, func(ctx context.Context, c *cluster, poolID string) error {
			a := c.hosts["node-a"]
			p := a.a.lookupPool(poolID)
			p.mu.Lock()
			owned := p.ring.owned(a.a.self)
			p.mu.Unlock()
			if len(owned) == 0 {
				return errors.New("node-a owns no space")
			}
			_, err := c.hosts["node-b"].request(ctx, poolID, addrOf(owned[0].first).String(), mac(2, 1))
			return err
		}},
		{"pool", kindPropose, func(ctx context.Context, c *cluster, _ string) error {
			_, err := c.hosts["node-b"].a.RequestPool(ctx, PoolRequest{Pool: "203.0.113.0/24"})
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, poolID := poolCluster(t, patient, "node-a", "node-b")
			c.converge(poolID)
			a, b := c.hosts["node-a"], c.hosts["node-b"]
			c.net.mu.Lock()
			c.net.drop = func(from, to string, payload []byte) bool {
				return from == "node-b" && len(payload) > 3 && msgKind(payload[3]) == tc.lost
			}
			sent := c.net.sent[tc.lost]
			c.net.mu.Unlock()
			done := make(chan error, 1)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			go func() { done <- tc.call(ctx, c, poolID) }()
			waitUntil(t, 10*time.Second, "node-b sends its request", func() bool {
				c.net.mu.Lock()
				defer c.net.mu.Unlock()
				return c.net.sent[tc.lost] > sent
			})
			b.a.applyReclaimed([]reclaimEntry{{id: b.a.self, by: a.a.self}})
			select {
			case err := <-done:
				if err == nil || ReasonOf(err) != ReasonIdentityReclaimed || !strings.Contains(err.Error(), "was reclaimed by node-a") {
					t.Fatalf("the waiting request ended with %v; want the reclaim's refusal (%s)", err, ReasonIdentityReclaimed)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the waiting request still waits for node-a's answer 10 s after the reclaim was learnt")
			}
		})
	}
}

// checkNoDuplicatesExcept is checkNoDuplicates leaving out a reclaimed
// host (whose containers, by reclaim's precondition, are gone).
func (c *cluster) checkNoDuplicatesExcept(poolID, skip string) {
	c.t.Helper()
	seen := map[uint32]string{}
	for _, n := range c.names() {
		if n == skip {
			continue
		}
		for _, x := range c.hosts[n].allocations(poolID) {
			if o, dup := seen[x]; dup {
				c.t.Fatalf("%s on %s and %s", addrOf(x), o, n)
			}
			seen[x] = n
		}
	}
}

// Status is JSON-friendly and says what the design promises: this host's
// ranges, free/used, cluster totals per owner, the gateway.
func TestStatus(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	a, b := c.hosts["node-a"], c.hosts["node-b"]
	poolID := a.requestPool(t, "192.0.2.0/28", "")
	b.requestPool(t, "192.0.2.0/28", "")
	for i := range 3 {
		if _, err := b.request(ctxT(t), poolID, "", mac(2, i)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.request(ctxT(t), poolID, "", mac(1, 0)); err != nil {
		t.Fatal(err)
	}
	var ps PoolStatus
	waitUntil(t, 5e9, "node-a hears node-b's figures", func() bool {
		ps = a.a.Status().Pools[0]
		for _, o := range ps.Owners {
			if o.Node == "node-b" && o.Reported && o.Used == 3 {
				return true
			}
		}
		return false
	})
	if ps.PoolID != poolID || ps.Prefix != "192.0.2.0/28" || ps.Gateway != "192.0.2.1" || ps.Range != "192.0.2.2-192.0.2.14" || ps.Size != 13 || ps.InUse != 1 {
		t.Fatalf("pool status %+v", ps)
	}
	if ps.LocalUsed != 1 || ps.LocalOwned != ps.LocalFree+ps.LocalUsed || len(ps.Ranges) == 0 {
		t.Fatalf("local figures %+v", ps)
	}
	if ps.ClusterUsed != 4 || ps.ClusterFree != 13-4 || ps.Unreported != 0 {
		t.Fatalf("cluster totals used %d free %d unreported %d, want 4, 9, 0", ps.ClusterUsed, ps.ClusterFree, ps.Unreported)
	}
	var owned uint64
	states := map[string]string{}
	for _, o := range ps.Owners {
		owned += o.Owned
		states[o.Node] = o.State
	}
	if owned != 13 || states["node-a"] != "self" || states["node-b"] != "alive" {
		t.Fatalf("owners %+v", ps.Owners)
	}
	c.stop("node-b")
	waitUntil(t, 5e9, "node-b shown dead", func() bool {
		for _, o := range a.a.Status().Pools[0].Owners {
			if o.Node == "node-b" {
				return o.State == "dead"
			}
		}
		return false
	})
}

// A reclaim against its precondition (node-c was only cut off, not gone)
// is what makes two hosts own one range. When node-c hears of it, it
// reports each of its allocations in the lost ranges as a conflict (status
// and an ERROR line) and refuses every request from then on.
func TestWrongReclaimIsReportedAsConflict(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, n := range c.names() {
		poolID = c.hosts[n].requestPool(t, "198.51.100.0/24", "")
	}
	cc := c.hosts["node-c"]
	for i := range 3 {
		if _, err := cc.request(ctxT(t), poolID, "", mac(3, i)); err != nil {
			t.Fatal(err)
		}
	}
	c.converge(poolID)
	c.net.partition("node-c", true)
	if _, err := c.hosts["node-a"].a.Reclaim(ctxT(t), "node-c"); err != nil {
		t.Fatal(err)
	}
	c.net.partition("node-c", false)
	waitUntil(t, 5*time.Second, "node-c reports its conflicts", func() bool {
		return len(cc.a.Status().Pools[0].Conflicts) == 3
	})
	if n := len(cc.logs.Events(logkeys.IPAMConflict)); n != 3 {
		t.Fatalf("%d ipam_conflict lines, want one per allocation (3)", n)
	}
	for _, r := range cc.logs.Events(logkeys.IPAMConflict) {
		if r.Level != slog.LevelError || r.Attrs[logkeys.Owner] == "" || r.Attrs[logkeys.Address] == "" {
			t.Fatalf("conflict line %v", r)
		}
	}
	_, err := cc.request(ctxT(t), poolID, "", mac(3, 9))
	wantErr(t, err, "was reclaimed by node-a")
}
