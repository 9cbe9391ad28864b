package cluster

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/peerdb"
)

func hosts(prefix string, from, n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("%s%d", prefix, from+i))
	}
	return out
}

func checkAllViolations(t *testing.T, nodes []*node) {
	t.Helper()
	for _, n := range nodes {
		n.w.checkViolations(t, n.name)
	}
}

// TestConvergeAddUpdateDelete: records added, updated and deleted on 4
// nodes converge on every node, with correct prevs.
func TestConvergeAddUpdateDelete(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "conv", hosts("127.0.0.", 11, 4), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	for i, n := range nodes {
		for j := range 3 {
			n.publish(100, n.peer(fmt.Sprintf("%s-ep%d", n.name, j), fmt.Sprintf("10.100.%d.%d", i, j+2)))
		}
		n.publish(200, n.peer(n.name+"-x", fmt.Sprintf("10.200.%d.2", i)))
	}
	d := waitConverged(t, 10*time.Second, nodes)
	t.Logf("adds converged in %v", d)

	// Update: new IP and MAC (a move within the node).
	for i, n := range nodes {
		n.publish(100, n.peer(n.name+"-ep0", fmt.Sprintf("10.100.%d.99", i)))
	}
	d = waitConverged(t, 10*time.Second, nodes)
	t.Logf("updates converged in %v", d)

	// Delete.
	for _, n := range nodes {
		n.unpublish(100, n.name+"-ep1")
		n.unpublish(200, n.name+"-x")
	}
	d = waitConverged(t, 10*time.Second, nodes)
	t.Logf("deletes converged in %v", d)
	checkAllViolations(t, nodes)

	st := nodes[0].c.Status()
	if len(st.Members) != 4 {
		t.Errorf("status members: %+v", st.Members)
	}
	for _, m := range st.Members {
		if m.State != StateAlive || m.Protocol != ProtocolVersion || !m.VTEP.IsValid() {
			t.Errorf("member %+v", m)
		}
	}
	want := map[uint32]VNIStatus{100: {VNI: 100, Local: 2, Remote: 6}}
	for _, v := range st.VNIs {
		if w, ok := want[v.VNI]; ok && v != w {
			t.Errorf("VNI status %+v, want %+v", v, w)
		}
	}
	if st.Node.KeyFingerprint != Fingerprint(testKey) || st.Node.KeyFingerprint == "" {
		t.Errorf("fingerprint %q", st.Node.KeyFingerprint)
	}
	js, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(js, testKey) || bytes.Contains(js, []byte(base64.StdEncoding.EncodeToString(testKey))) {
		t.Error("status reveals the key")
	}
	if !bytes.Contains(js, []byte(`"state":"alive"`)) || !bytes.Contains(js, []byte(`"key_fingerprint":"`+Fingerprint(testKey)+`"`)) {
		t.Errorf("status JSON: %s", js)
	}
	// Each VNI told in order and never concurrently (checked by the
	// watcher): with 4 shards, at most 4 concurrent Watcher calls.
	if m := nodes[0].w.maxConc.Load(); m > DefaultDeliveryShards {
		t.Errorf("%d concurrent watcher calls", m)
	}
	if st.Stats.PeersChangedCalls == 0 || st.Stats.PeersChangedKeys < st.Stats.PeersChangedCalls {
		t.Errorf("stats: %+v", st.Stats)
	}
}

// TestReorderDuplicateConverges: packets duplicated and delayed at random
// (so reordered) still converge to the final state, and the receivers did
// see stale duplicates (the fault injection worked).
func TestReorderDuplicateConverges(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "dup", hosts("127.0.0.", 21, 3), nodeOpts{dupProb: 0.5, maxDelay: 40 * time.Millisecond})
	waitMembers(t, 10*time.Second, nodes)
	for round := range 15 {
		for i, n := range nodes {
			for j := range 6 {
				id := fmt.Sprintf("%s-%d", n.name, j)
				if round%5 == 4 && j%2 == 0 {
					if _, ok := n.local[n.key(7, id)]; ok {
						n.unpublish(7, id)
					}
					continue
				}
				n.publish(7, n.peer(id, fmt.Sprintf("10.7.%d.%d", i, 2+(round*6+j)%250)))
			}
		}
		time.Sleep(3 * time.Millisecond) // spread the rounds over several packets (not synchronisation)
	}
	waitConverged(t, 15*time.Second, nodes)
	checkAllViolations(t, nodes)
	var stale uint64
	for _, n := range nodes {
		stale += n.c.Status().Stats.StaleRecords
	}
	if stale == 0 {
		t.Errorf("no stale (duplicated/reordered) record was seen: fault injection ineffective")
	}
	t.Logf("stale records ignored: %d", stale)
}

// partitionable starts n nodes on 127.0.0.from… that a partition can cut
// apart, with a short FailedGrace (each side drops the other's records
// soon), and waits until they are members.
func partitionable(t *testing.T, prefix string, from, n int) ([]*node, []string, *partition) {
	t.Helper()
	part := &partition{}
	hs := hosts("127.0.0.", from, n)
	nodes := startCluster(t, prefix, hs, nodeOpts{part: part, tweak: func(c *Config) { c.FailedGrace = 500 * time.Millisecond }})
	waitMembers(t, 10*time.Second, nodes)
	return nodes, hs, part
}

// TestPartitionHeals: two groups cut apart drop each other's records,
// change their own meanwhile, and converge to one state when healed.
func TestPartitionHeals(t *testing.T) {
	t.Parallel()
	nodes, hs, part := partitionable(t, "pt", 51, 5)
	for i, n := range nodes {
		n.publish(51, n.peer(n.name+"-a", fmt.Sprintf("10.51.%d.2", i)))
	}
	waitConverged(t, 10*time.Second, nodes)

	a, b := nodes[:2], nodes[2:]
	part.set(hs[:2], hs[2:])
	waitMembers(t, 15*time.Second, a)
	waitMembers(t, 15*time.Second, b)
	waitConverged(t, 10*time.Second, a)
	waitConverged(t, 10*time.Second, b)
	t.Log("partitioned: each side dropped the other's records")
	// Changes on both sides while cut off.
	a[0].publish(51, a[0].peer(a[0].name+"-a", "10.51.0.77"))
	a[1].publish(52, a[1].peer(a[1].name+"-new", "10.52.1.2"))
	b[0].unpublish(51, b[0].name+"-a")
	b[2].publish(51, b[2].peer(b[2].name+"-new", "10.51.4.9"))
	waitConverged(t, 10*time.Second, a)
	waitConverged(t, 10*time.Second, b)

	part.heal()
	start := time.Now()
	// Memberlist alone heals only while it still gossips to the dead
	// (slowly, ~13 s here); the reconnect loop does it in about a second.
	waitMembers(t, 8*time.Second, nodes)
	waitConverged(t, 10*time.Second, nodes)
	t.Logf("healed to one state in %v", time.Since(start))
	checkAllViolations(t, nodes)
}

// TestWrongKeyRefused: a node with another key can neither join nor
// inject records; a member with the right key cannot inject records for
// a VTEP that is not its own or someone else's.
func TestWrongKeyRefused(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "wk", hosts("127.0.0.", 61, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	for i, n := range nodes {
		n.publish(61, n.peer(n.name+"-a", fmt.Sprintf("10.61.%d.2", i)))
	}
	waitConverged(t, 10*time.Second, nodes)
	authFailed := func() uint64 { return nodes[0].c.Status().Dropped[DropGossipAuth] }
	before := authFailed()

	otherKey := []byte("another key of thirty-two bytes!")
	x := startNode(t, "intruder", "127.0.0.64", 0, nodeOpts{key: otherKey, seeds: []string{nodes[0].addr()}})
	x.publish(61, x.peer("evil", "10.61.9.9"))
	waitFor(t, 10*time.Second, "the intruder's join to be refused", func() (bool, string) {
		return authFailed() > before, fmt.Sprint("auth failures ", authFailed())
	})
	// Inject directly: a delta claiming to come from a member, over UDP and
	// TCP, encrypted with the wrong key.
	forged := mustEncode(t, &message{Type: msgDelta, Origin: nodes[1].name, Incarnation: nodes[1].c.inc,
		Records: []record{liveRec(61, "evil2", "10.61.9.10", nodes[1].host, uint64(time.Now().UnixNano()))}})
	target := &memberlist.Node{Name: nodes[0].name, Addr: net.ParseIP(nodes[0].host), Port: uint16(nodes[0].port)}
	mid := authFailed()
	_ = x.c.ml.SendBestEffort(target, forged)
	_ = x.c.ml.SendReliable(target, forged)
	waitFor(t, 10*time.Second, "the injected messages to be refused", func() (bool, string) {
		return authFailed() >= mid+2, fmt.Sprint("auth failures ", authFailed())
	})
	if n := x.c.ml.NumMembers(); n != 1 {
		t.Errorf("intruder sees %d members", n)
	}
	for _, n := range nodes {
		if memberState(n.c, "intruder") != "" {
			t.Errorf("%s knows the intruder", n.name)
		}
		for k := range n.w.snapshot() {
			if k.EndpointID == "evil" || k.EndpointID == "evil2" {
				t.Errorf("%s accepted %v", n.name, k)
			}
		}
	}
	if len(x.w.snapshot()) != 0 || len(x.c.Peers(61)) != 0 {
		t.Errorf("intruder received records: %v", x.w.snapshot())
	}

	// Right key, wrong VTEP: node 2 forges a record of node 3 with another
	// VTEP, and one of its own with node 3's VTEP.
	for _, rec := range []record{
		liveRec(61, "forged", "10.61.8.8", "10.99.99.99", uint64(time.Now().UnixNano())),
		liveRec(61, "forged2", "10.61.8.9", nodes[2].host, uint64(time.Now().UnixNano())),
	} {
		origin := nodes[2]
		if rec.EndpointID == "forged2" {
			origin = nodes[1]
		}
		b := mustEncode(t, &message{Type: msgDelta, Origin: origin.name, Incarnation: origin.c.inc, Records: []record{rec}})
		before := nodes[0].c.Status().Dropped[DropVTEPMatch]
		if err := nodes[1].c.ml.SendBestEffort(target, b); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 5*time.Second, "the forged record to be dropped", func() (bool, string) {
			return nodes[0].c.Status().Dropped[DropVTEPMatch] > before, ""
		})
	}
	waitConverged(t, 5*time.Second, nodes)
	checkAllViolations(t, nodes)
}

// TestBadInputCounted: bad messages from the network are dropped and
// counted under the right reason, whether they arrive through memberlist
// or directly; none changes what is in force.
func TestBadInputCounted(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "bad", hosts("127.0.0.", 71, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	a, b := nodes[0], nodes[1]
	b.publish(71, b.peer("ok", "10.71.0.2"))
	waitConverged(t, 10*time.Second, nodes)

	cases := badCases(t)
	now := uint64(time.Now().UnixNano())
	apply := []badCase{
		{"vtep mismatch", mustEncode(t, &message{Type: msgDelta, Origin: b.name, Incarnation: b.c.inc,
			Records: []record{liveRec(71, "x", "10.71.0.3", "10.9.9.9", now)}}), DropVTEPMatch},
		{"unknown origin", mustEncode(t, &message{Type: msgDelta, Origin: "nobody", Incarnation: 1,
			Records: []record{liveRec(71, "x", "10.71.0.3", "10.9.9.9", now)}}), DropUnknownOrig},
		{"old incarnation", mustEncode(t, &message{Type: msgDelta, Origin: b.name, Incarnation: b.c.inc - 1,
			Records: []record{liveRec(71, "x", "10.71.0.3", b.host, now)}}), DropIncarnation},
		{"self origin", mustEncode(t, &message{Type: msgDelta, Origin: a.name, Incarnation: a.c.inc,
			Records: []record{liveRec(71, "x", "10.71.0.3", a.host, now)}}), DropSelfOrigin},
	}
	cases = append(cases, apply...)
	target := &memberlist.Node{Name: a.name, Addr: net.ParseIP(a.host), Port: uint16(a.port)}
	for _, tc := range cases {
		if len(tc.b) == 0 {
			continue // memberlist does not deliver empty user messages
		}
		before := a.c.Status().Dropped
		// Through the real network from b (encrypted with the right key),
		// except the oversized one, which goes straight in (memberlist's
		// own stream limit is 20 MiB; UDP cannot carry it).
		if len(tc.b) > 1<<20 {
			a.c.handleMessage(tc.b)
		} else if err := b.c.ml.SendReliable(target, tc.b); err != nil {
			t.Fatalf("%s: send: %v", tc.name, err)
		}
		waitFor(t, 5*time.Second, tc.name+" to be counted", func() (bool, string) {
			after := a.c.Status().Dropped
			for r, n := range after {
				if r != tc.reason && n != before[r] && r != DropGossipAuth {
					return false, fmt.Sprintf("counted under %s, want %s", r, tc.reason)
				}
			}
			return after[tc.reason] == before[tc.reason]+1, fmt.Sprintf("%s: %d -> %d", tc.reason, before[tc.reason], after[tc.reason])
		})
	}
	if d := diffState(a.w.snapshot(), expectedFor(a, nodes)); d != "" {
		t.Errorf("records changed: %s", d)
	}
	if d := diffState(a.c.Peers(71), expectedFor(a, nodes)); d != "" {
		t.Errorf("records in force changed: %s", d)
	}
	checkAllViolations(t, nodes)
	// Invalid local records are refused and counted.
	bad := a.peer("local-bad", "224.0.0.1")
	a.c.PublishLocalPeer(71, nil, &bad)
	other := peerdb.Peer{EndpointID: "other-vtep", IP: netip.MustParseAddr("10.71.0.9"), MAC: peerdb.MACFromIP(netip.MustParseAddr("10.71.0.9")), VTEP: netip.MustParseAddr("10.1.1.1")}
	a.c.PublishLocalPeer(71, nil, &other)
	a.c.PublishLocalPeer(0, nil, &bad)
	if n := a.c.Status().Dropped[DropLocalInvalid]; n != 3 {
		t.Errorf("local_invalid = %d, want 3", n)
	}
}

// TestLeaveRemovesAtOnce: a node that leaves explicitly loses its records
// everywhere at once (well within FailedGrace, which applies to failures
// only) and is shown as left.
func TestLeaveRemovesAtOnce(t *testing.T) {
	t.Parallel()
	const grace = 30 * time.Second
	nodes := startCluster(t, "lv", hosts("127.0.0.", 81, 3), nodeOpts{tweak: func(c *Config) { c.FailedGrace = grace }})
	waitMembers(t, 10*time.Second, nodes)
	for i, n := range nodes {
		n.publish(81, n.peer(n.name+"-a", fmt.Sprintf("10.81.%d.2", i)))
	}
	waitConverged(t, 10*time.Second, nodes)
	if err := nodes[2].c.Leave(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	took := waitConverged(t, 5*time.Second, nodes[:2])
	t.Logf("left node's records removed in %v (FailedGrace %v)", took, grace)
	for _, n := range nodes[:2] {
		waitFor(t, 5*time.Second, "left state", func() (bool, string) {
			s := memberState(n.c, nodes[2].name)
			return s == StateLeft, string(s)
		})
		if r := n.w.removalsOf(nodes[2].key(81, nodes[2].name+"-a")); r != 1 {
			t.Errorf("%s: the left node's record was removed %d times", n.name, r)
		}
	}
	_ = nodes[2].c.Shutdown()
	checkAllViolations(t, nodes)
}

// TestPeersOfAnswersAsPeer: the batched lookup the driver pulls with
// gives, key by key, what Peer gives: a live record of another node, none
// for an endpoint it never had, for a record of this node (it is never
// pulled), for one of a node that left, or for a record under another
// VNI; every answer is written, over whatever the slot held before.
func TestPeersOfAnswersAsPeer(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "po", hosts("127.0.0.", 151, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	a, b, gone := nodes[0], nodes[1], nodes[2]
	for i, n := range nodes {
		n.publish(151, n.peer(n.name+"-x", fmt.Sprintf("198.51.100.%d", 10+i)))
	}
	a.publish(152, a.peer(a.name+"-y", "198.51.100.20"))
	waitConverged(t, 10*time.Second, nodes)
	if err := gone.c.Leave(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	waitConverged(t, 5*time.Second, nodes[:2])
	_ = gone.c.Shutdown()

	keys := []peerdb.Key{
		a.key(151, a.name+"-x"),       // found
		a.key(151, "never"),           // no such endpoint
		b.key(151, b.name+"-x"),       // the asker's own
		gone.key(151, gone.name+"-x"), // left
		a.key(152, a.name+"-y"),       // found, another VNI
		a.key(152, a.name+"-x"),       // a's endpoint, but not under 152
	}
	found := make([]peerdb.Found, len(keys))
	for i := range found {
		found[i] = peerdb.Found{Peer: peerdb.Peer{EndpointID: "stale"}, OK: true}
	}
	b.c.PeersOf(keys, found)
	for i, k := range keys {
		p, ok := b.c.Peer(k)
		if found[i].OK != ok || found[i].Peer != p {
			t.Errorf("PeersOf for %v gave %+v (ok %v), Peer gives %+v (ok %v)", k, found[i].Peer, found[i].OK, p, ok)
		}
	}
	if !found[0].OK || !found[4].OK || found[1].OK || found[2].OK || found[3].OK || found[5].OK {
		t.Errorf("found %+v, want only keys 0 and 4", found)
	}
	checkAllViolations(t, nodes[:2])
}

// TestSeedsInBackground: New does not wait for seeds; a node whose seed
// is not up yet joins once it is.
func TestSeedsInBackground(t *testing.T) {
	t.Parallel()
	start := time.Now()
	port := freePort(t, "127.0.0.91")
	late := startNode(t, "sd2", "127.0.0.92", 0, nodeOpts{seeds: []string{fmt.Sprintf("127.0.0.91:%d", port)}})
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("New took %v with an unreachable seed", d)
	}
	late.publish(91, late.peer("l", "10.91.0.2"))
	first := startNode(t, "sd1", "127.0.0.91", port, nodeOpts{})
	first.publish(91, first.peer("f", "10.91.0.3"))
	nodes := []*node{first, late}
	waitMembers(t, 15*time.Second, nodes)
	waitConverged(t, 10*time.Second, nodes)
	// AddSeeds (swarm's DiscoverNew) joins a third node in.
	third := startNode(t, "sd3", "127.0.0.93", 0, nodeOpts{})
	third.publish(91, third.peer("t", "10.91.0.4"))
	first.c.AddSeeds(third.addr(), first.addr())
	nodes = append(nodes, third)
	waitMembers(t, 10*time.Second, nodes)
	waitConverged(t, 10*time.Second, nodes)
	checkAllViolations(t, nodes)
}

// TestConfigValidation covers New's refusals.
func TestConfigValidation(t *testing.T) {
	base := func() Config {
		return Config{NodeName: "n", BindAddr: netip.MustParseAddr("127.0.0.1"), BindPort: 1, Key: testKey, Watcher: newTestWatcher("n")}
	}
	for name, mod := range map[string]func(*Config){
		"no name":       func(c *Config) { c.NodeName = "" },
		"no key":        func(c *Config) { c.Key = nil },
		"short key":     func(c *Config) { c.Key = []byte("short") },
		"no watcher":    func(c *Config) { c.Watcher = nil },
		"bad vtep":      func(c *Config) { c.VTEP = netip.MustParseAddr("224.0.0.1") },
		"probe timeout": func(c *Config) { c.ProbeTimeout = time.Second },
		"bad profile":   func(c *Config) { c.Profile = Profile{Name: "metro"} },
		"wan timeout":   func(c *Config) { c.Profile = Profile{Name: "wan", ProbeTimeout: 2 * time.Second} },
	} {
		cfg := base()
		mod(&cfg)
		if c, err := New(cfg); err == nil {
			c.Shutdown()
			t.Errorf("%s: New succeeded", name)
		}
	}
	cfg := DefaultConfig()
	if err := cfg.normalize(); err == nil {
		t.Error("DefaultConfig without identity normalized")
	}
	if cfg.BindPort != 7947 || cfg.BindPort == 7946 {
		t.Errorf("default port %d", cfg.BindPort)
	}
	if cfg.FailedGrace != DefaultFailedGrace || DefaultFailedGrace != 10*time.Second {
		t.Errorf("default FailedGrace %v", cfg.FailedGrace)
	}
	neg := base()
	neg.FailedGrace = -1
	if err := neg.normalize(); err != nil || neg.FailedGrace != 0 {
		t.Errorf("negative FailedGrace: %v, %v", neg.FailedGrace, err)
	}
}

// The application state a node advertises reaches every other node, and a
// change of it is announced through OnMembersChange.
func TestAppStateReachesMembers(t *testing.T) {
	var changes atomic.Int64
	nodes := startCluster(t, "app", hosts("127.0.0.", 201, 3), nodeOpts{tweak: func(c *Config) {
		c.OnMembersChange = func() { changes.Add(1) }
	}})
	waitFor(t, 10*time.Second, "membership", func() (bool, string) {
		for _, n := range nodes {
			if st := n.c.AppStates(); len(st) != 3 {
				return false, fmt.Sprintf("%s sees %d members", n.name, len(st))
			}
		}
		return true, ""
	})
	before := changes.Load()
	if err := nodes[1].c.SetAppState([]byte("keys:1")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "application state", func() (bool, string) {
		for _, n := range nodes {
			if st := n.c.AppStates(); string(st[nodes[1].name]) != "keys:1" {
				return false, fmt.Sprintf("%s sees %q", n.name, st)
			}
		}
		return true, ""
	})
	if changes.Load() == before {
		t.Fatal("OnMembersChange was not called for the update")
	}
	// MemberApps: every other alive member with its VTEP and state, not
	// this node.
	for _, n := range nodes {
		apps := n.c.MemberApps()
		if len(apps) != 2 {
			t.Fatalf("%s: MemberApps %+v", n.name, apps)
		}
		for i, a := range apps {
			if a.Name == n.name {
				t.Errorf("%s: MemberApps lists this node", n.name)
			}
			if i > 0 && apps[i-1].Name >= a.Name {
				t.Errorf("%s: MemberApps not sorted: %+v", n.name, apps)
			}
			var o *node
			for _, m := range nodes {
				if m.name == a.Name {
					o = m
				}
			}
			if o == nil || a.VTEP != o.vtep {
				t.Errorf("%s: MemberApps entry %+v", n.name, a)
			}
			if want := ""; o == nodes[1] {
				want = "keys:1"
				if string(a.App) != want {
					t.Errorf("%s: app of %s %q, want %q", n.name, a.Name, a.App, want)
				}
			} else if len(a.App) != 0 {
				t.Errorf("%s: app of %s %q, want none", n.name, a.Name, a.App)
			}
		}
	}
	if err := nodes[1].c.SetAppState(make([]byte, MaxAppState+1)); err == nil {
		t.Fatal("oversized application state accepted")
	}
}
