package cluster

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/overlayd/overlayd/peerdb"
)

// arrivals counts, per endpoint id, how many receivers have applied its
// create and its delete, and when the last one did.
type arrivals struct {
	mu        sync.Mutex
	receivers int
	adds      map[string]int
	dels      map[string]int
	doneAdd   map[string]chan time.Time
	doneDel   map[string]chan time.Time
	batch     string // id prefix of a bulk batch
	batchN    int    // creates of the batch applied so far
	batchWant int
	batchDone chan time.Time
}

func newArrivals(receivers int) *arrivals {
	return &arrivals{receivers: receivers, adds: map[string]int{}, dels: map[string]int{},
		doneAdd: map[string]chan time.Time{}, doneDel: map[string]chan time.Time{}}
}

func (a *arrivals) expectAdd(id string, receivers int) chan time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	ch := make(chan time.Time, 1)
	a.doneAdd[id] = ch
	a.adds[id] = a.receivers - receivers
	return ch
}

func (a *arrivals) expectDel(id string, receivers int) chan time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	ch := make(chan time.Time, 1)
	a.doneDel[id] = ch
	a.dels[id] = a.receivers - receivers
	return ch
}

func (a *arrivals) expectBatch(prefix string, want int) chan time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.batch, a.batchN, a.batchWant, a.batchDone = prefix, 0, want, make(chan time.Time, 1)
	return a.batchDone
}

func (a *arrivals) on(_ peerdb.Key, prev, next *peerdb.Peer, at time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case next != nil && prev == nil:
		id := next.EndpointID
		if a.batch != "" && len(id) > len(a.batch) && id[:len(a.batch)] == a.batch {
			a.batchN++
			if a.batchN == a.batchWant {
				a.batchDone <- at
			}
			return
		}
		if ch := a.doneAdd[id]; ch != nil {
			a.adds[id]++
			if a.adds[id] == a.receivers {
				ch <- at
				delete(a.doneAdd, id)
			}
		}
	case next == nil:
		id := prev.EndpointID
		if ch := a.doneDel[id]; ch != nil {
			a.dels[id]++
			if a.dels[id] == a.receivers {
				ch <- at
				delete(a.doneDel, id)
			}
		}
	}
}

func pct(d []time.Duration, p float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(p/100*float64(len(s)) + 0.5)
	return s[min(max(i-1, 0), len(s)-1)]
}

// TestBenchCluster measures, on loopback with the default timings:
// convergence latency of one record (publish on one node until delivered
// on all others) at 3, 10 and 50 nodes; the time for 1,000 records
// published at once by one node to reach all others; gossip bytes per
// peer change; the time from an abrupt shutdown to removal everywhere.
// Heavy: set OVERLAYD_BENCH_CLUSTER=1 (and run with -v).
func TestBenchCluster(t *testing.T) {
	if os.Getenv("OVERLAYD_BENCH_CLUSTER") == "" {
		t.Skip("set OVERLAYD_BENCH_CLUSTER=1 to run the cluster benchmark (50 memberlist nodes)")
	}
	sizes := []int{3, 10, 50}
	if s := os.Getenv("OVERLAYD_BENCH_SIZES"); s != "" {
		sizes = nil
		for _, f := range splitComma(s) {
			n, _ := strconv.Atoi(f)
			sizes = append(sizes, n)
		}
	}
	for _, n := range sizes {
		t.Run(fmt.Sprintf("nodes=%d", n), func(t *testing.T) { benchCluster(t, n) })
	}
}

func splitComma(s string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ',' {
			if i > start {
				out = append(out, s[start:i])
			}
			start = i + 1
		}
	}
	return out
}

func benchCluster(t *testing.T, n int) {
	var bytes atomic.Int64
	arr := newArrivals(n - 1)
	defaults := func(c *Config) {
		d := DefaultConfig()
		c.DigestInterval, c.ReconnectInterval = d.DigestInterval, d.ReconnectInterval
		c.FailedGrace = -1 // measure failure detection: records out at the death
	}
	var nodes []*node
	failures := func() uint64 {
		var f uint64
		for _, nd := range nodes {
			if !nd.c.closed.Load() {
				f += nd.c.Status().Stats.MemberFailures
			}
		}
		return f
	}
	for i := range n {
		o := nodeOpts{bytes: &bytes, tweak: defaults}
		if i > 0 {
			o.seeds = []string{nodes[0].addr()}
		}
		nd := startNode(t, fmt.Sprintf("b%02d", i), fmt.Sprintf("127.0.1.%d", i+1), 0, o)
		nd.w.mu.Lock()
		nd.w.onChange = arr.on
		nd.w.mu.Unlock()
		nodes = append(nodes, nd)
	}
	start := time.Now()
	waitMembers(t, 60*time.Second, nodes)
	t.Logf("n=%d: all members see each other after %v", n, time.Since(start))
	// Let the joins' sync requests and first digests settle.
	time.Sleep(3 * time.Second)
	noFailures := func(phase string) {
		if f := failures(); f != 0 {
			t.Errorf("n=%d: false positives: %d member failures declared by the end of %s", n, f, phase)
		}
	}
	noFailures("the join")

	// 1. Latency of one record.
	samples := 200
	if n >= 50 {
		samples = 100
	}
	var lat []time.Duration
	for i := range samples {
		p := nodes[rand.N(n)]
		id := fmt.Sprintf("lat-%d", i)
		ch := arr.expectAdd(id, n-1)
		t0 := time.Now()
		p.publish(1000, p.peer(id, fmt.Sprintf("10.%d.%d.%d", 50+i/250, 0, 1+i%250)))
		select {
		case at := <-ch:
			lat = append(lat, at.Sub(t0))
		case <-time.After(10 * time.Second):
			t.Fatalf("record %s not delivered everywhere in 10 s", id)
		}
	}
	noFailures("the latency runs")
	t.Logf("n=%d: one record to all %d others: p50 %v p90 %v p99 %v max %v (%d samples)",
		n, n-1, pct(lat, 50), pct(lat, 90), pct(lat, 99), pct(lat, 100), len(lat))

	// 2. Bytes per change: updates of one record vs an idle period.
	idleStart, idleBytes := time.Now(), bytes.Load()
	time.Sleep(4 * time.Second)
	idleRate := float64(bytes.Load()-idleBytes) / time.Since(idleStart).Seconds()
	p := nodes[n-1]
	var appBytes uint64
	for _, nd := range nodes {
		appBytes += nd.c.Status().Stats.BytesSent
	}
	changes := 100
	b0, t0 := bytes.Load(), time.Now()
	for i := range changes {
		id := fmt.Sprintf("bytes-%d", i)
		ch := arr.expectAdd(id, n-1)
		p.publish(1001, p.peer(id, fmt.Sprintf("10.60.%d.%d", i/250, 1+i%250)))
		<-ch
	}
	dur := time.Since(t0)
	total := float64(bytes.Load() - b0)
	var appBytes2 uint64
	for _, nd := range nodes {
		appBytes2 += nd.c.Status().Stats.BytesSent
	}
	perChange := (total - idleRate*dur.Seconds()) / float64(changes)
	t.Logf("n=%d: gossip bytes per peer change: %.0f on the wire (all %d copies, minus idle %.0f B/s), %.0f per receiver; record payload %.0f B/change",
		n, perChange, n-1, idleRate, perChange/float64(n-1), float64(appBytes2-appBytes)/float64(changes))
	t.Logf("n=%d: idle traffic %.0f B/s for the cluster (%.0f B/s per node)", n, idleRate, idleRate/float64(n))

	noFailures("the bytes runs")
	// 3. 1,000 records at once from one node.
	for _, k := range []int{0, 1} {
		p := nodes[(k*7+1)%n]
		prefix := fmt.Sprintf("bulk%d-", k)
		ch := arr.expectBatch(prefix, 1000*(n-1))
		t0 := time.Now()
		for i := range 1000 {
			p.publish(uint32(2000+k), p.peer(fmt.Sprintf("%s%04d", prefix, i), fmt.Sprintf("10.%d.%d.%d", 70+k, i/250, 1+i%250)))
		}
		pubDur := time.Since(t0)
		select {
		case at := <-ch:
			t.Logf("n=%d: 1,000 records from one node delivered on all %d others in %v (publishing took %v)", n, n-1, at.Sub(t0), pubDur)
		case <-time.After(60 * time.Second):
			t.Fatalf("1,000 records not delivered everywhere in 60 s")
		}
	}

	noFailures("the bulk runs")
	// 4. Abrupt shutdown until removal everywhere.
	var fd []time.Duration
	victims := min(3, n-2)
	for v := range victims {
		victim := nodes[n-1-v]
		id := "fd-" + victim.name
		ch := arr.expectAdd(id, n-1-v)
		victim.publish(1002, victim.peer(id, fmt.Sprintf("10.80.0.%d", 1+v)))
		<-ch
		del := arr.expectDel(id, n-1-v)
		t0 := time.Now()
		_ = victim.c.Shutdown()
		select {
		case at := <-del:
			fd = append(fd, at.Sub(t0))
		case <-time.After(30 * time.Second):
			t.Fatalf("failed node %s not removed everywhere in 30 s", victim.name)
		}
	}
	t.Logf("n=%d: abrupt shutdown to removal on all others: %v", n, fd)

	// False positives: no surviving node was ever declared dead.
	alive := nodes[:n-victims]
	for _, nd := range alive {
		for _, m := range nd.c.Status().Members {
			isVictim := false
			for _, v := range nodes[n-victims:] {
				isVictim = isVictim || v.name == m.Name
			}
			if !isVictim && m.State != StateAlive {
				t.Errorf("false positive: %s sees %s as %s", nd.name, m.Name, m.State)
			}
		}
		nd.w.checkViolations(t, nd.name)
	}
	var nfail, refuted uint64
	for _, nd := range alive {
		st := nd.c.Status().Stats
		nfail += st.MemberFailures
		refuted += st.IncarnationChanges
	}
	if want := uint64(victims * len(alive)); nfail != want {
		t.Errorf("false positives: %d members declared dead, want %d (the victims)", nfail, want)
	}
	if refuted != 0 {
		t.Errorf("incarnation changes seen: %d", refuted)
	}
	t.Logf("n=%d: %d failures seen (victims: %d)", n, nfail, victims*len(alive))
}
