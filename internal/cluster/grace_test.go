package cluster

import (
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/peerdb"
)

// sampler polls, on each observer, Peer and Peers for some keys every
// millisecond until finished, and notes every sample in which a key was
// not in force (and when that was first seen). It observes what a
// consumer pulling at any moment would get, independently of the
// Watcher's calls.
type sampler struct {
	stop    chan struct{}
	done    sync.WaitGroup
	mu      sync.Mutex
	samples int
	misses  map[string]int       // "observer key" -> samples without it
	first   map[string]time.Time // "observer key" -> first such sample
}

func startSampler(obs []*node, keys []peerdb.Key) *sampler {
	s := &sampler{stop: make(chan struct{}), misses: map[string]int{}, first: map[string]time.Time{}}
	for _, o := range obs {
		s.done.Add(1)
		go func() {
			defer s.done.Done()
			tick := time.NewTicker(time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-s.stop:
					return
				case <-tick.C:
				}
				now := time.Now()
				byVNI := map[uint32]map[peerdb.Key]peerdb.Peer{}
				s.mu.Lock()
				s.samples++
				s.mu.Unlock()
				for _, k := range keys {
					_, ok := o.c.Peer(k)
					if byVNI[k.VNI] == nil {
						byVNI[k.VNI] = o.c.Peers(k.VNI)
					}
					_, inPeers := byVNI[k.VNI][k]
					if !ok || !inPeers {
						id := o.name + " " + k.String()
						s.mu.Lock()
						if s.misses[id] == 0 {
							s.first[id] = now
						}
						s.misses[id]++
						s.mu.Unlock()
					}
				}
			}
		}()
	}
	return s
}

// finish stops the sampler and returns the number of samples and the
// misses.
func (s *sampler) finish() (int, map[string]int) {
	close(s.stop)
	s.done.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.samples, s.misses
}

// firstMiss returns when observer o first missed k (zero: never).
func (s *sampler) firstMiss(o *node, k peerdb.Key) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.first[o.name+" "+k.String()]
}

func memberStatus(c *Cluster, name string) (MemberStatus, bool) {
	for _, m := range c.Status().Members {
		if m.Name == name {
			return m, true
		}
	}
	return MemberStatus{}, false
}

func memberState(c *Cluster, name string) MemberState {
	m, _ := memberStatus(c, name)
	return m.State
}

// waitDead waits until every observer has declared name dead.
func waitDead(t *testing.T, obs []*node, name string) {
	t.Helper()
	waitDeadWithin(t, 15*time.Second, obs, name)
}

// waitDeadWithin waits until every observer has declared name dead, at
// most timeout, and returns how long that took.
func waitDeadWithin(t *testing.T, timeout time.Duration, obs []*node, name string) time.Duration {
	t.Helper()
	return waitFor(t, timeout, name+" declared dead by every observer", func() (bool, string) {
		for _, o := range obs {
			if s := memberState(o.c, name); s != StateDead {
				return false, fmt.Sprintf("%s sees %s", o.name, s)
			}
		}
		return true, ""
	})
}

// waitAliveAs waits until every observer sees v alive at v's address with
// v's current incarnation.
func waitAliveAs(t *testing.T, timeout time.Duration, obs []*node, v *node) time.Duration {
	t.Helper()
	return waitFor(t, timeout, v.name+" alive again", func() (bool, string) {
		for _, o := range obs {
			m, _ := memberStatus(o.c, v.name)
			if m.State != StateAlive || m.Addr.String() != v.host || m.Incarnation != v.c.inc {
				return false, fmt.Sprintf("%s sees %s %s at %v incarnation %d", o.name, v.name, m.State, m.Addr, m.Incarnation)
			}
		}
		return true, ""
	})
}

// restart starts a new process of v (same name) at host (its current one
// if empty; port 0 there picks a new one), which publishes recs before it
// can be reached, then joins seed.
func (v *node) restart(host string, seed string, tweak func(*Config), recs func(*node)) time.Time {
	if host != "" && host != v.host {
		v.host, v.vtep, v.port = host, netip.MustParseAddr(host), 0
	}
	v.local = map[peerdb.Key]peerdb.Peer{}
	start := time.Now()
	v.start(nodeOpts{held: true, tweak: tweak})
	recs(v)
	v.tr.held.Store(false)
	v.c.AddSeeds(seed)
	return start
}

// TestRestartWithinFailedGrace: a node shut down without leaving is
// declared dead, but its records stay in force on the others (FailedGrace);
// when it comes back as a new process within the grace, records that did
// not change are never out of force (sampled continuously) and never
// removed and re-added (the Watcher's copy); the record it did not
// republish goes, its new one comes.
func TestRestartWithinFailedGrace(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "rg", hosts("127.0.0.", 111, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	v, obs := nodes[2], nodes[:2]
	for i, n := range nodes {
		n.publish(111, n.peer(n.name+"-a", fmt.Sprintf("10.111.%d.2", i)))
	}
	v.publish(111, v.peer("keep1", "10.111.9.2"))
	v.publish(112, v.peer("keep2", "10.112.9.3"))
	v.publish(111, v.peer("gone", "10.111.9.4"))
	waitConverged(t, 10*time.Second, nodes)
	keep := []peerdb.Key{v.key(111, "keep1"), v.key(112, "keep2"), v.key(111, v.name+"-a")}
	smp := startSampler(obs, keep)

	t0 := time.Now()
	_ = v.c.Shutdown()
	waitDead(t, obs, v.name)
	detected := time.Since(t0)
	for _, o := range obs {
		if m, _ := memberStatus(o.c, v.name); m.InForceUntil.IsZero() {
			t.Errorf("%s: dead member's status shows no grace: %+v", o.name, m)
		}
	}

	oldInc := v.c.inc
	v.restart("", obs[0].addr(), nil, func(v *node) {
		v.publish(111, v.peer(v.name+"-a", "10.111.2.2"))
		v.publish(111, v.peer("keep1", "10.111.9.2"))
		v.publish(112, v.peer("keep2", "10.112.9.3"))
		v.publish(111, v.peer("new", "10.111.9.5"))
	})
	back := waitAliveAs(t, 15*time.Second, obs, v)
	conv := waitConverged(t, 10*time.Second, nodes)
	samples, misses := smp.finish()
	t.Logf("declared dead after %v; the restarted process alive everywhere %v after its start, its records converged after %v more (%d samples)",
		detected, back, conv, samples)
	if v.c.inc == oldInc {
		t.Fatal("the restart kept its incarnation")
	}
	if len(misses) != 0 {
		t.Errorf("records out of force during the death and restart: %v", misses)
	}
	for _, o := range obs {
		for _, k := range keep {
			if r := o.w.removalsOf(k); r != 0 {
				t.Errorf("%s: unchanged %v removed %d times", o.name, k, r)
			}
		}
		if r := o.w.removalsOf(v.key(111, "gone")); r != 1 {
			t.Errorf("%s: the record not republished was removed %d times", o.name, r)
		}
		st := o.c.Status().Stats
		if st.MemberFailures == 0 || st.MemberReturns == 0 || st.FailedGraceExpired != 0 {
			t.Errorf("%s: stats %+v", o.name, st)
		}
	}
	checkAllViolations(t, nodes)
}

// TestQuickRestartNoFlap: a node that restarts at once (before or while
// it is declared dead) re-publishes its records; the others keep them in
// force across the restart (no removal of unchanged records) and take its
// new state.
func TestQuickRestartNoFlap(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "qr", hosts("127.0.0.", 41, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	r, obs := nodes[2], nodes[:2]
	r.publish(41, r.peer("keep", "10.41.0.2"))
	r.publish(41, r.peer("drop", "10.41.0.3"))
	waitConverged(t, 10*time.Second, nodes)
	smp := startSampler(obs, []peerdb.Key{r.key(41, "keep")})
	_ = r.c.Shutdown()
	r.restart("", obs[0].addr(), nil, func(r *node) {
		r.publish(41, r.peer("keep", "10.41.0.2"))
		r.publish(41, r.peer("new", "10.41.0.4"))
	})
	waitAliveAs(t, 15*time.Second, obs, r)
	waitConverged(t, 10*time.Second, nodes)
	_, misses := smp.finish()
	if len(misses) != 0 {
		t.Errorf("unchanged record out of force during the restart: %v", misses)
	}
	for _, n := range obs {
		if k := r.key(41, "keep"); n.w.removalsOf(k) != 0 {
			t.Errorf("%s: unchanged record flapped", n.name)
		}
		if k := r.key(41, "drop"); n.w.removalsOf(k) != 1 {
			t.Errorf("%s: dropped record removed %d times", n.name, n.w.removalsOf(k))
		}
	}
	checkAllViolations(t, nodes)
}

// TestFailedGraceThenOut: a node shut down without leaving keeps its
// records in force everywhere until FailedGrace after its death, then they
// go (once, told through the Watcher); they come back when it rejoins.
func TestFailedGraceThenOut(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	nodes := startCluster(t, "fd", hosts("127.0.0.", 31, 4), nodeOpts{tweak: func(c *Config) { c.FailedGrace = grace }})
	waitMembers(t, 10*time.Second, nodes)
	for i, n := range nodes {
		n.publish(33, n.peer(n.name+"-a", fmt.Sprintf("10.33.%d.2", i)))
		n.publish(34, n.peer(n.name+"-b", fmt.Sprintf("10.34.%d.3", i)))
	}
	waitConverged(t, 10*time.Second, nodes)

	victim, rest := nodes[3], nodes[:3]
	keys := []peerdb.Key{victim.key(33, victim.name+"-a"), victim.key(34, victim.name+"-b")}
	smp := startSampler(rest, keys)
	start := time.Now()
	_ = victim.c.Shutdown()
	waitDead(t, rest, victim.name)
	detected := time.Since(start)
	deaths := map[string]time.Time{}
	for _, n := range rest {
		m, _ := memberStatus(n.c, victim.name)
		deaths[n.name] = m.Since
		if want := m.Since.Add(grace); !m.InForceUntil.Equal(want) {
			t.Errorf("%s: in force until %v, want %v", n.name, m.InForceUntil, want)
		}
	}
	out := waitConverged(t, grace+8*time.Second, rest)
	smp.finish()
	t.Logf("declared dead everywhere %v after the shutdown; records out of force everywhere after %v (FailedGrace %v)",
		detected, time.Since(start), grace)
	_ = out
	for _, n := range rest {
		for _, k := range keys {
			miss := smp.firstMiss(n, k)
			if d := miss.Sub(deaths[n.name]); miss.IsZero() || d < grace || d > grace+2*time.Second {
				t.Errorf("%s: %v out of force %v after the death, want FailedGrace %v (up to a tick more)", n.name, k, d, grace)
			}
			if r := n.w.removalsOf(k); r != 1 {
				t.Errorf("%s: %v removed %d times", n.name, k, r)
			}
		}
		if st := n.c.Status().Stats; st.FailedGraceExpired != 1 {
			t.Errorf("%s: failed grace expired %d times", n.name, st.FailedGraceExpired)
		}
	}

	// Rejoin: a new process with the same name and address, which
	// publishes its endpoints again (one changed set).
	victim.restart("", nodes[0].addr(), func(c *Config) { c.FailedGrace = grace }, func(v *node) {
		v.publish(33, v.peer(v.name+"-a", "10.33.3.2"))
		v.publish(33, v.peer(v.name+"-c", "10.33.3.4"))
	})
	waitMembers(t, 10*time.Second, nodes)
	waitConverged(t, 10*time.Second, nodes)
	checkAllViolations(t, nodes)
}

// TestRestartAtNewAddress: a node stopped without leaving comes back at
// once with another underlay address (same name). Memberlist refuses the
// new address while the old one is alive; once the old address is
// declared dead the node is accepted at the new one within moments
// (deadNodeReclaimTime, and the members join the claimed address), and
// its records carry the new VTEP. They stay in force throughout (old VTEP
// until the new ones arrive).
func TestRestartAtNewAddress(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "na", hosts("127.0.0.", 121, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	v, obs := nodes[2], nodes[:2]
	for i, n := range nodes {
		n.publish(121, n.peer(n.name+"-a", fmt.Sprintf("10.121.%d.2", i)))
	}
	v.publish(122, v.peer("b", "10.122.2.3"))
	waitConverged(t, 10*time.Second, nodes)
	keys := []peerdb.Key{v.key(121, v.name+"-a"), v.key(122, "b")}
	smp := startSampler(obs, keys)

	oldHost := v.host
	_ = v.c.Shutdown()
	start := v.restart("127.0.0.124", obs[0].addr(), nil, func(v *node) {
		v.publish(121, v.peer(v.name+"-a", "10.121.2.2"))
		v.publish(122, v.peer("b", "10.122.2.3"))
	})
	var firstDead time.Duration
	alive := waitFor(t, 20*time.Second, "alive at the new address", func() (bool, string) {
		ok, detail := true, ""
		for _, o := range obs {
			m, _ := memberStatus(o.c, v.name)
			if m.State == StateDead && firstDead == 0 {
				firstDead = time.Since(start)
			}
			if m.State != StateAlive || m.Addr.String() != v.host || m.Incarnation != v.c.inc {
				ok, detail = false, fmt.Sprintf("%s sees %s %s at %v", o.name, v.name, m.State, m.Addr)
			}
		}
		return ok, detail
	})
	conv := waitConverged(t, 10*time.Second, nodes)
	samples, misses := smp.finish()
	t.Logf("restarted at %s (was %s): old address declared dead ~%v after the new process started, alive at the new address everywhere after %v, records with the new VTEP after %v more (%d samples)",
		v.host, oldHost, firstDead, alive, conv, samples)
	// Failure detection of the old address takes 1.4-5 s here (more on a
	// loaded machine); acceptance at the new one must follow at once
	// (memberlist's former 30 s DeadNodeReclaimTime made it 30 s).
	if firstDead == 0 || alive-firstDead > 3*time.Second || alive > 15*time.Second {
		t.Errorf("the node took %v to be accepted at its new address (old address declared dead after %v)", alive, firstDead)
	}
	if len(misses) != 0 {
		t.Errorf("records out of force during the move: %v", misses)
	}
	for _, o := range obs {
		for _, k := range keys {
			if p, ok := o.c.Peer(k); !ok || p.VTEP != v.vtep {
				t.Errorf("%s: %v is %v, want VTEP %v", o.name, k, p, v.vtep)
			}
			if r := o.w.removalsOf(k); r != 0 {
				t.Errorf("%s: %v removed %d times", o.name, k, r)
			}
		}
	}
	_ = start
	checkAllViolations(t, nodes)
}

// TestSetVTEP: a node that changes its VTEP re-publishes its records with
// it; the other node converges on the new VTEP (metadata and records)
// without the records ever leaving force, and from then on only records of
// the new VTEP are published.
func TestSetVTEP(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "vt", hosts("127.0.0.", 131, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	a, b := nodes[0], nodes[1]
	a.publish(131, a.peer("x", "10.131.0.2"))
	a.publish(131, a.peer("y", "10.131.0.3"))
	a.publish(132, a.peer("z", "10.132.0.2"))
	b.publish(131, b.peer("bx", "10.131.1.2"))
	waitConverged(t, 10*time.Second, nodes)
	keys := []peerdb.Key{a.key(131, "x"), a.key(131, "y"), a.key(132, "z")}
	smp := startSampler([]*node{b}, keys)

	oldV, newV := a.vtep, netip.MustParseAddr("127.0.0.231")
	want := map[peerdb.Key]peerdb.Peer{}
	for k, p := range a.local {
		p.VTEP = newV
		want[k] = p
	}
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- a.c.SetVTEP(newV) }() // it blocks while memberlist retransmits the metadata
	took := waitFor(t, 10*time.Second, "the new VTEP's records in force at b", func() (bool, string) {
		d := diffState(inForce(b, vnisOf(want)), expectedFor(b, []*node{b, {name: a.name, local: want}}))
		return d == "", d
	})
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	t.Logf("the other node holds the new VTEP's records %v after SetVTEP was called (SetVTEP returned after %v)", took, time.Since(start))
	a.vtep, a.local = newV, want
	waitConverged(t, 10*time.Second, nodes)
	_, misses := smp.finish()
	if len(misses) != 0 {
		t.Errorf("records out of force during the VTEP change: %v", misses)
	}
	for _, k := range keys {
		if r := b.w.removalsOf(k); r != 0 {
			t.Errorf("%v removed %d times", k, r)
		}
	}
	if a.c.VTEP() != newV || a.c.Status().Node.VTEP != newV {
		t.Errorf("VTEP %v, status %v", a.c.VTEP(), a.c.Status().Node.VTEP)
	}
	waitFor(t, 5*time.Second, "the new VTEP in b's view", func() (bool, string) {
		m, _ := memberStatus(b.c, a.name)
		apps := b.c.MemberApps()
		return m.VTEP == newV && len(apps) == 1 && apps[0].VTEP == newV, fmt.Sprintf("%v %+v", m.VTEP, apps)
	})

	// Records of the old VTEP are refused; of the new one, published.
	before := a.c.Status().Dropped[DropLocalInvalid]
	ip := netip.MustParseAddr("10.131.0.9")
	stale := peerdb.Peer{EndpointID: "w", IP: ip, MAC: peerdb.MACFromIP(ip), VTEP: oldV}
	a.c.PublishLocalPeer(131, nil, &stale)
	if n := a.c.Status().Dropped[DropLocalInvalid]; n != before+1 {
		t.Errorf("record of the old VTEP not refused: %d refusals", n-before)
	}
	a.publish(131, a.peer("w", "10.131.0.9"))
	waitConverged(t, 10*time.Second, nodes)

	if err := a.c.SetVTEP(newV); err != nil {
		t.Errorf("SetVTEP to the current VTEP: %v", err)
	}
	if err := a.c.SetVTEP(netip.MustParseAddr("224.0.0.1")); err == nil || !strings.Contains(err.Error(), "224.0.0.1") {
		t.Errorf("multicast VTEP: %v", err)
	}
	if a.c.VTEP() != newV {
		t.Errorf("a refused VTEP changed it to %v", a.c.VTEP())
	}
	checkAllViolations(t, nodes)
}

// TestBlockedWatcherCoalesces: while the Watcher is blocked (its network
// lock held), the cluster keeps merging (Peers is current) and bursts
// coalesce: once it is free, one or two calls carry every change.
func TestBlockedWatcherCoalesces(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "bw", hosts("127.0.0.", 141, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	a, b := nodes[0], nodes[1]
	b.w.net.Lock()
	before := b.w.calls.Load()
	for i := range 200 {
		a.publish(141, a.peer(fmt.Sprintf("e%02d", i%20), fmt.Sprintf("10.141.%d.%d", i/100, 2+i%100)))
	}
	waitFor(t, 10*time.Second, "records in force at b while its watcher is blocked", func() (bool, string) {
		d := diffState(b.c.Peers(141), expectedFor(b, nodes))
		return d == "", d
	})
	if got := b.w.snapshot(); len(got) != 0 {
		t.Fatalf("the blocked watcher's copy changed: %v", got)
	}
	b.w.net.Unlock()
	waitConverged(t, 10*time.Second, nodes)
	if calls := b.w.calls.Load() - before; calls > 3 {
		t.Errorf("%d Watcher calls for one burst of one VNI", calls)
	}
	checkAllViolations(t, nodes)
}
