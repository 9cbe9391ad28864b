package ipam

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// blockingStore holds its first write until released.
type blockingStore struct {
	*memStore
	first   chan struct{}
	release chan struct{}
	once    sync.Once
	mu      *lockorder.Mutex
	batches []int // keys per write; guarded by mu
}

func (s *blockingStore) WriteIPAM(puts map[string][]byte) error {
	s.once.Do(func() { close(s.first); <-s.release })
	s.mu.Lock()
	s.batches = append(s.batches, len(puts))
	s.mu.Unlock()
	return s.memStore.WriteIPAM(puts)
}

// The journal writes one batch at a time: marks made while a write runs
// go together in the next one, and each waiter returns when its mark is on
// disk; a failed write fails its waiters, and its changes go with the next
// write.
func TestJournalGroupsAndOrders(t *testing.T) {
	s := &blockingStore{memStore: newMemStore(), first: make(chan struct{}), release: make(chan struct{}), mu: lockorder.New(lockorder.LevelLeaf)}
	j := newJournal(s)
	firstDone := make(chan error, 1)
	go func() { firstDone <- j.wait(j.mark1("k0", []byte("0"))) }()
	<-s.first
	const n = 20
	errs := make(chan error, n)
	for i := range n {
		seq := j.mark1("k", []byte{byte(i)}) // the same key: the last mark wins
		j.mark1("other"+string(rune('a'+i)), []byte("x"))
		go func() { errs <- j.wait(seq) }()
	}
	close(s.release)
	if err := <-firstDone; err != nil {
		t.Fatal(err)
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	s.mu.Lock()
	batches := append([]int(nil), s.batches...)
	s.mu.Unlock()
	if len(batches) != 2 || batches[1] != 1+n {
		t.Fatalf("writes of %v keys, want 2 writes, the second with %d keys", batches, 1+n)
	}
	if got := snapshot(s.memStore)["k"]; len(got) != 1 || got[0] != n-1 {
		t.Fatalf("k = %v, want the last mark %d", got, n-1)
	}
	s.setFailing(errDisk)
	seq := j.mark1("late", []byte("1"))
	if err := j.wait(seq); !errors.Is(err, errDisk) {
		t.Fatalf("failed write: %v", err)
	}
	s.setFailing(nil)
	if err := j.sync(); err != nil {
		t.Fatal(err)
	}
	if string(snapshot(s.memStore)["late"]) != "1" {
		t.Fatal("a failed write's change was lost instead of going with the next write")
	}
}

// injectProposal makes node-b vote for a claim of node-a that node-a does
// not run, while node-a is cut off (so that nothing resolves it yet).
func injectProposal(t *testing.T, c *cluster, claim claimID) {
	t.Helper()
	a, b := c.hosts["node-a"], c.hosts["node-b"]
	m, err := a.a.encode(&message{kind: kindPropose, pool: "overlayd:198.51.100.0/24", claim: claim})
	if err != nil {
		t.Fatal(err)
	}
	c.net.partition("node-a", true)
	b.a.HandleMessage("node-a", m)
	waitUntil(t, 5*time.Second, "node-b votes for the claim", func() bool {
		st := b.a.Status()
		return len(st.Pools) == 1 && st.Pools[0].PendingClaim != ""
	})
	if _, ok := snapshot(b.store.(*memStore))[prefixVote+"overlayd:198.51.100.0/24"]; !ok {
		t.Fatal("node-b's vote is not on disk")
	}
	// The vote blocks claims while node-a is unreachable.
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = b.a.RequestPool(ctx, PoolRequest{Pool: "198.51.100.0/24"})
	wantErr(t, err, "this host accepted node-a's claim of it and awaits its outcome", "overlayd ipam reclaim node-a")
}

// A voter left holding its vote for a claim its proposer gave up (the
// abort lost) asks the proposer, hears the abort, and the pool can be
// created.
func TestStuckVoteIsResolved(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	injectProposal(t, c, claimID{proposer: c.hosts["node-a"].a.self, nonce: 12345})
	c.net.partition("node-a", false)
	b := c.hosts["node-b"]
	if id := b.requestPool(t, "198.51.100.0/24", ""); id != "overlayd:198.51.100.0/24" {
		t.Fatal(id)
	}
	if st := b.a.Status(); st.Pools[0].PendingClaim != "" {
		t.Fatalf("vote still pending: %q", st.Pools[0].PendingClaim)
	}
}

// A proposer that restarts with its claim pending aborts it (it never won:
// the win and the ring are one write), and the voters let go without
// asking (node-b here never asks).
func TestRestartAbortsPendingClaim(t *testing.T) {
	c := newCluster(t, "node-a")
	noQuery := testTiming
	noQuery.query = time.Hour
	c.startWith("node-b", newMemStore(), noQuery)
	a, b := c.hosts["node-a"], c.hosts["node-b"]
	claim := claimID{proposer: a.a.self, nonce: 777}
	injectProposal(t, c, claim)
	// node-a "crashed" with that claim and its own vote on disk.
	store := a.store.(*memStore)
	c.remove("node-a")
	store.data[prefixClaim+"overlayd:198.51.100.0/24"] = encodeClaim(claim)
	store.data[prefixVote+"overlayd:198.51.100.0/24"] = encodeClaim(claim)
	c.net.mu.Lock()
	c.net.cut = map[[2]string]bool{}
	c.net.mu.Unlock()
	c.start("node-a", store)
	waitUntil(t, 5*time.Second, "node-b hears the abort", func() bool {
		return b.a.Status().Pools[0].PendingClaim == ""
	})
	if _, ok := snapshot(store)[prefixClaim+"overlayd:198.51.100.0/24"]; ok {
		t.Fatal("the pending claim is still on node-a's disk")
	}
}

// Lost and delayed messages: every exchange recovers (timeouts, other
// donors, anti-entropy), and no address is ever handed out twice.
func TestLostAndDelayedMessages(t *testing.T) {
	c := newCluster(t, "node-a", "node-b", "node-c")
	var poolID string
	for _, n := range c.names() {
		poolID = c.hosts[n].requestPool(t, "198.51.100.0/24", "")
	}
	rng := rand.New(rand.NewPCG(7, 7))
	var mu sync.Mutex
	c.net.mu.Lock()
	c.net.delay = 3 * time.Millisecond
	c.net.drop = func(from, to string, payload []byte) bool {
		mu.Lock()
		defer mu.Unlock()
		return rng.IntN(4) == 0 // a quarter of everything
	}
	c.net.mu.Unlock()
	got, _ := c.burst(poolID, 60)
	c.checkNoDuplicates(poolID)
	for _, n := range c.names() {
		if len(got[n]) == 0 {
			t.Fatalf("%s got no address with a quarter of the messages lost", n)
		}
	}
	c.net.mu.Lock()
	c.net.drop = nil
	c.net.mu.Unlock()
	c.converge(poolID)
	c.checkNoDuplicates(poolID)
}

// A member that appears gets every ring without asking.
func TestNewMemberGetsRings(t *testing.T) {
	c := newCluster(t, "node-a")
	poolID := c.hosts["node-a"].requestPool(t, "198.51.100.0/24", "")
	c.start("node-b", newMemStore())
	c.converge(poolID)
	// And it knows node-a uses the pool: an overlapping pool is refused.
	waitUntil(t, 5*time.Second, "node-b refuses an overlapping pool", func() bool {
		_, err := c.hosts["node-b"].a.RequestPool(ctxT(t), PoolRequest{Pool: "198.51.100.0/25"})
		return err != nil
	})
}

// Each anti-entropy tick sends the pools whose figures changed to every
// member, not only to the random one that gets all rings: one tick is
// enough for everyone's status totals.
func TestFiguresReachEveryMemberInOneTick(t *testing.T) {
	quiet := testTiming
	quiet.gossip = time.Hour // ticks only when the test calls them
	c, poolID := poolCluster(t, quiet, "node-a", "node-b", "node-c")
	b := c.hosts["node-b"]
	for i := range 4 {
		if _, err := b.request(ctxT(t), poolID, "", mac(2, i)); err != nil {
			t.Fatal(err)
		}
	}
	b.a.antiEntropy()
	for _, n := range []string{"node-a", "node-c"} {
		waitUntil(t, 5*time.Second, n+" has node-b's figures", func() bool {
			for _, o := range c.hosts[n].a.Status().Pools[0].Owners {
				if o.Node == "node-b" && o.Reported && o.Used == 4 {
					return true
				}
			}
			return false
		})
	}
}

// TestRingsNumberedByFigures: a receiver keeps the figures of the highest
// sequence number it saw from a host, so a rings message must be numbered
// when its figures are read, not when it is encoded. node-b builds a
// message, hands out 3 addresses, builds another; the second is encoded
// and delivered first, the first after it: node-c must keep the second's
// figures (3 used), not the first's (0).
func TestRingsNumberedByFigures(t *testing.T) {
	quiet := testTiming
	quiet.gossip = time.Hour // ticks only when the test calls them
	c, poolID := poolCluster(t, quiet, "node-a", "node-b", "node-c")
	c.converge(poolID)
	b, cc := c.hosts["node-b"], c.hosts["node-c"]
	pools := []*pool{b.a.lookupPool(poolID)}
	older := b.a.ringsMessages(pools)
	for i := range 3 {
		if _, err := b.request(ctxT(t), poolID, "", mac(2, i)); err != nil {
			t.Fatal(err)
		}
	}
	newer := b.a.ringsMessages(pools)
	for _, m := range slices.Concat(newer, older) {
		payload, err := b.a.encode(m)
		if err != nil {
			t.Fatal(err)
		}
		cc.a.handle("node-b", payload)
	}
	owners := cc.a.Status().Pools[0].Owners
	i := slices.IndexFunc(owners, func(o OwnerStatus) bool { return o.Node == "node-b" })
	if i < 0 || !owners[i].Reported || owners[i].Used != 3 {
		t.Fatalf("node-c keeps node-b's figures as %+v, want the newer message's 3 used", owners)
	}
}

// Close sends what is queued first (a won claim's commit, a changed ring),
// even over a slow transport.
func TestCloseSendsWhatIsQueued(t *testing.T) {
	c := newCluster(t, "node-a", "node-b")
	a := c.hosts["node-a"].a
	c.net.mu.Lock()
	c.net.slow = 20 * time.Millisecond
	c.net.mu.Unlock()
	for i := range 5 {
		a.sendMsg("node-b", &message{kind: kindQuery, pool: "overlayd:198.51.100.0/24", claim: claimID{proposer: a.self, nonce: uint64(i)}})
	}
	a.Close()
	c.net.mu.Lock()
	defer c.net.mu.Unlock()
	if got := c.net.sent[kindQuery]; got != 5 {
		t.Fatalf("%d of 5 queued messages sent before Close returned", got)
	}
}
