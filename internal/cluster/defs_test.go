package cluster

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/overlayd/overlayd/internal/netdef"
)

// defsAt returns what n has in force for vni as "host=MTU" strings, sorted.
func defsAt(n *node, vni uint32) []string {
	var out []string
	for _, r := range n.c.Definitions(vni) {
		if r.Pending {
			continue
		}
		out = append(out, fmt.Sprintf("%s=%d", r.Host, r.Def.MTU))
	}
	return out
}

// checkDefinitionOf fails unless n's DefinitionOf(vni, host) is exactly
// host's entry in n's Definitions(vni), for every host named, and absent
// for the hosts not listed.
func checkDefinitionOf(t *testing.T, n *node, vni uint32, hosts ...string) {
	t.Helper()
	// Both under one hold of the lock, so that they see the same state.
	n.c.mu.Lock()
	list := n.c.replica.definitions(vni)
	one := make(map[string]netdef.Remote)
	for _, h := range hosts {
		if r, ok := n.c.replica.definitionOf(vni, h, n.c.replica.members[h]); ok {
			one[h] = r
		}
	}
	n.c.mu.Unlock()
	for _, want := range list {
		got, ok := one[want.Host]
		if !ok || got.Host != want.Host || got.VTEP != want.VTEP || got.Pending != want.Pending || !netdef.Equal(&got.Def, &want.Def) {
			t.Fatalf("%s: DefinitionOf(%d, %q) = %+v (listed %v), Definitions lists %+v", n.name, vni, want.Host, got, ok, want)
		}
		delete(one, want.Host)
	}
	for h, r := range one {
		t.Fatalf("%s: DefinitionOf(%d, %q) = %+v, but Definitions does not list it", n.name, vni, h, r)
	}
}

func waitDefs(t *testing.T, n *node, vni uint32, want ...string) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("%s's definitions of VNI %d to be %v", n.name, vni, want), func() (bool, string) {
		got := defsAt(n, vni)
		return slices.Equal(got, want), fmt.Sprint(got)
	})
}

// TestDefinitionsReplicate: each node's network definitions reach every
// member, with their host and VTEP; a withdrawn one disappears; a node cut
// off keeps them in force for FailedGrace only, and they are back once
// the partition heals; a restarted node's definitions are those of its
// new process.
func TestDefinitionsReplicate(t *testing.T) {
	t.Parallel()
	nodes, hs, part := partitionable(t, "df", 151, 3)
	a, b, c := nodes[0], nodes[1], nodes[2]
	da := sampleDef(1450, false, 151)
	db := sampleDef(1400, true, 151, 152)
	if err := a.c.PublishDefinition(151, &da); err != nil {
		t.Fatal(err)
	}
	b.c.SyncDefinitions(b.c.LocalMark(), map[uint32]netdef.Definition{151: db, 152: db})
	waitDefs(t, c, 151, a.name+"=1450", b.name+"=1400")
	waitDefs(t, c, 152, b.name+"=1400")
	waitDefs(t, a, 151, b.name+"=1400") // never its own
	names := []string{a.name, b.name, c.name, "nobody"}
	for _, n := range nodes {
		checkDefinitionOf(t, n, 151, names...)
		checkDefinitionOf(t, n, 152, names...) // pending ones too
	}
	if p := a.c.Definitions(152); len(p) != 2 || p[0].Pending || p[1].Host != c.name || !p[1].Pending {
		t.Fatalf("%s's definitions of VNI 152: %+v, want %s's and %s pending (it has none)", a.name, p, b.name, c.name)
	}
	got := c.c.Definitions(151)
	if len(got) != 2 {
		t.Fatalf("%s has %d definitions of VNI 151, want 2: %+v", c.name, len(got), got)
	}
	if got[1].VTEP != b.vtep || !netdef.Equal(&got[1].Def, &db) {
		t.Fatalf("%s's definition as seen by %s: %+v, want VTEP %v and %+v", b.name, c.name, got[1], b.vtep, db)
	}

	// Withdrawn (the network was deleted): gone everywhere.
	b.c.SyncDefinitions(b.c.LocalMark(), map[uint32]netdef.Definition{152: db})
	waitDefs(t, c, 151, a.name+"=1450")
	waitDefs(t, c, 152, b.name+"=1400")

	// An invalid definition is refused, not published.
	bad := sampleDef(1450, false, 153)
	if err := a.c.PublishDefinition(154, &bad); err == nil {
		t.Fatal("a definition that does not define its own VNI was published")
	}

	// a cut off: the others drop its definitions after FailedGrace, and
	// have them again once healed.
	part.set(hs[:1], hs[1:])
	waitDefs(t, c, 151)
	checkDefinitionOf(t, c, 151, names...) // a is not in force
	part.heal()
	waitDefs(t, c, 151, a.name+"=1450")

	// A restart: the new process publishes another set, which replaces
	// the former one.
	b.stop()
	b.start(nodeOpts{part: part, seeds: []string{a.addr()}, tweak: func(cfg *Config) {
		cfg.LocalDefinitions = map[uint32]netdef.Definition{151: da}
	}})
	waitDefs(t, c, 151, a.name+"=1450", b.name+"=1450")
	waitDefs(t, c, 152)
	checkDefinitionOf(t, c, 151, names...)
	checkDefinitionOf(t, c, 152, names...)
	checkAllViolations(t, nodes)
}

// TestDefinitionsSpareProtocol1Members: a member that speaks only
// protocol 1 (an overlayd from before definitions) is never sent one (it
// would drop the message as an unknown type), and it is not listed as
// pending, so its records are not held back waiting for one.
func TestDefinitionsSpareProtocol1Members(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "dv", hosts("127.0.0.", 161, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	cur, old := nodes[0], nodes[1]
	old.advertiseProtocol(1)
	waitFor(t, 10*time.Second, "the protocol-1 metadata to arrive", func() (bool, string) {
		st := cur.c.Status()
		for _, m := range st.Members {
			if m.Name == old.name {
				return m.Protocol == 1, fmt.Sprint("protocol ", m.Protocol)
			}
		}
		return false, "not a member"
	})
	// (It was sent cur's empty set when it joined as a protocol-2 node.)
	before := old.c.Status().Stats.Definitions
	def := sampleDef(1450, false, 161)
	if err := cur.c.PublishDefinition(161, &def); err != nil {
		t.Fatal(err)
	}
	// Definitions go out with every digest: after two digests from cur,
	// old would have had two chances to get them.
	digests := old.c.Status().Stats.Digests
	waitFor(t, 10*time.Second, "two digests to arrive", func() (bool, string) {
		d := old.c.Status().Stats.Digests
		return d >= digests+2, fmt.Sprint(d - digests)
	})
	if st := old.c.Status(); st.Stats.Definitions != before || st.Dropped[DropUnknownType] != 0 {
		t.Fatalf("the protocol-1 member was sent definitions: %d applied, %d dropped", st.Stats.Definitions-before, st.Dropped[DropUnknownType])
	}
	if d := cur.c.Definitions(161); len(d) != 0 {
		t.Fatalf("the protocol-1 member is listed for VNI 161: %+v (its records would wait for a definition that never comes)", d)
	}
	if r, ok := cur.c.DefinitionOf(161, old.name); ok {
		t.Fatalf("DefinitionOf lists the protocol-1 member for VNI 161: %+v", r)
	}
}

// TestDefinitionsAskedForUntilTheyArrive: a member of protocol 2 whose
// records came in a complete view (push/pull brings a snapshot but no
// definitions) without its definitions is asked again until its set
// arrives, and then no more. Before, nothing asked: its records waited for
// its next digest, up to DigestMaxInterval (a restart test lost its peers
// for more than 20 s).
func TestDefinitionsAskedForUntilTheyArrive(t *testing.T) {
	r := newReceiver(5, "10.0.0.1")
	n := mlNode("o", 5, "10.0.0.1")
	n.Meta = encodeMeta(nodeMeta{ProtoMin: 1, ProtoMax: protoDefs, Incarnation: 5, VTEP: netip.MustParseAddr("10.0.0.1")})
	t0 := time.Unix(10, 0)
	r.s.memberAlive(n, t0)
	rec := liveRec(7, "e", "10.7.0.2", "10.0.0.1", 3)
	if reason, d := r.s.apply(&message{Type: msgSnapshot, Origin: "o", Incarnation: 5, AsOf: 3, Records: []record{rec}}, t0); reason != "" {
		t.Fatal(reason, d)
	}
	before := r.syncTo["o"]
	r.s.tick(t0.Add(2 * syncRetry))
	if r.syncTo["o"] != before+1 {
		t.Fatalf("a member whose definitions never came was not asked again (%d requests)", r.syncTo["o"]-before)
	}
	def := sampleDef(1450, false, 7)
	if reason, d := r.s.apply(&message{Type: msgDefs, Origin: "o", Incarnation: 5, AsOf: 4, Defs: []defRecord{{VNI: 7, Def: def}}}, t0.Add(3*syncRetry)); reason != "" {
		t.Fatal(reason, d)
	}
	if reason, d := r.s.apply(&message{Type: msgDigest, Origin: "o", Incarnation: 5, AsOf: 4, Count: 1, Hash: recordHash(&rec)}, t0.Add(3*syncRetry)); reason != "" {
		t.Fatal(reason, d)
	}
	before = r.syncTo["o"]
	r.s.tick(t0.Add(5 * syncRetry))
	if r.syncTo["o"] != before {
		t.Fatalf("asked %d more times after the definitions came", r.syncTo["o"]-before)
	}
	if d := r.s.definitions(7); len(d) != 1 || d[0].Pending || !netdef.Equal(&d[0].Def, &def) {
		t.Fatalf("definitions of VNI 7: %+v", d)
	}
}

// dualStackDef is a definition of vni with one segment: 198.51.100.0/24
// (unless v6only) and two IPv6 subnets, the second without a gateway.
func dualStackDef(vni uint32, v6only bool) netdef.Definition {
	s := netdef.Subnet{VNI: vni, IPv6: []netdef.Subnet6{
		{Pool: netip.MustParsePrefix("2001:db8:1::/64"), Gateway: netip.MustParsePrefix("2001:db8:1::1/64")},
		{Pool: netip.MustParsePrefix("2001:db8:2::/120")},
	}}
	if !v6only {
		s.Pool, s.Gateway = netip.MustParsePrefix("198.51.100.0/24"), netip.MustParsePrefix("198.51.100.1/24")
	}
	return netdef.Definition{MTU: 1450, Subnets: []netdef.Subnet{s}}
}

// Definitions with IPv6 subnets (dual-stack and IPv6-only) cross the wire
// unchanged; one without IPv6 keeps protocol 2's subnet encoding (its flag
// byte is the gateway flag 0 or 1 older nodes know).
func TestDefinitionsWithIPv6Encode(t *testing.T) {
	m := &message{Type: msgDefs, Origin: "h", Incarnation: 1, AsOf: 3, Defs: []defRecord{
		{VNI: 300, Def: dualStackDef(300, false)},
		{VNI: 301, Def: dualStackDef(301, true)},
		{VNI: 302, Def: sampleDef(1450, false, 302)},
	}}
	got, derr := decodeMessage(mustEncode(t, m))
	if derr != nil {
		t.Fatal(derr)
	}
	for i := range m.Defs {
		if got.Defs[i].VNI != m.Defs[i].VNI || !netdef.Equal(&got.Defs[i].Def, &m.Defs[i].Def) {
			t.Errorf("definition %d decodes as %+v, want %+v", i, got.Defs[i], m.Defs[i])
		}
	}
	b := appendDef(nil, &defRecord{VNI: 302, Def: sampleDef(1450, false, 302)})
	const flagAt = 3 + 1 + 2 + 1 + 3 + 4 + 1 // def header, subnet VNI, pool, bits
	if b[flagAt] != 1 || len(b) != flagAt+1+4 {
		t.Errorf("an IPv4 definition encodes as %x: subnet flag %d, want protocol 2's layout", b, b[flagAt])
	}
}

// Malformed IPv6 parts of a definition are dropped, naming what is wrong.
func TestDefinitionsWithIPv6Malformed(t *testing.T) {
	good := appendDef(nil, &defRecord{VNI: 300, Def: dualStackDef(300, true)})
	const flagAt = 3 + 1 + 2 + 1 + 3 + 4 + 1
	for _, tc := range []struct {
		name   string
		mutate func(b []byte) []byte
		reason DropReason
	}{
		{"unknown subnet flag", func(b []byte) []byte { b[flagAt] |= 1 << 5; return b }, DropMalformed},
		{"no IPv4 but a gateway", func(b []byte) []byte { b[flagAt] |= subGateway; return b }, DropMalformed},
		{"no IPv4 but pool bytes", func(b []byte) []byte { b[flagAt-2] = 7; return b }, DropMalformed},
		{"IPv6 announced, none given", func(b []byte) []byte { b[flagAt+1] = 0; return b[:flagAt+2] }, DropMalformed},
		{"IPv6 prefix length 129", func(b []byte) []byte { b[flagAt+2+16] = 129; return b }, DropInvalidDefinition},
		{"IPv6 gateway flag 2", func(b []byte) []byte { b[flagAt+2+17] = 2; return b }, DropMalformed},
		{"link-local IPv6 pool", func(b []byte) []byte { b[flagAt+2], b[flagAt+3] = 0xfe, 0x80; return b }, DropInvalidDefinition},
		{"truncated", func(b []byte) []byte { return b[:len(b)-3] }, DropTruncated},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &reader{b: tc.mutate(slices.Clone(good))}
			var d defRecord
			err := decodeDef(r, &d)
			if err == nil {
				t.Fatalf("decoded %+v", d)
			}
			if err.Reason != tc.reason {
				t.Errorf("dropped as %s (%s), want %s", err.Reason, err.Detail, tc.reason)
			}
		})
	}
}

// A member older than protocol 4 is sent the definitions without IPv6 only
// (it would drop the whole set as malformed otherwise); members of
// protocol 4 get them all.
func TestDefinitionsWithIPv6SpareOlderMembers(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "d6", hosts("127.0.0.", 171, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	cur, old := nodes[0], nodes[1]
	cur.advertiseProtocol(protoDefs6)
	old.advertiseProtocol(protoDefs6)
	dual := dualStackDef(171, false)
	if err := cur.c.PublishDefinition(171, &dual); err != nil {
		t.Fatal(err)
	}
	waitDefs(t, old, 171, cur.name+"=1450")
	if got := old.c.Definitions(171); len(got) != 1 || !netdef.Equal(&got[0].Def, &dual) {
		t.Fatalf("the protocol-4 member holds %+v, want %+v", got, dual)
	}

	old.advertiseProtocol(protoDefs6 - 1)
	waitFor(t, 10*time.Second, "the protocol-3 metadata to arrive", func() (bool, string) {
		for _, m := range cur.c.Status().Members {
			if m.Name == old.name {
				return m.Protocol == protoDefs6-1, fmt.Sprint("protocol ", m.Protocol)
			}
		}
		return false, "not a member"
	})
	v4 := sampleDef(1400, false, 172)
	cur.c.SyncDefinitions(cur.c.LocalMark(), map[uint32]netdef.Definition{171: dual, 172: v4})
	// The set old gets lacks VNI 171 (so it is gone there) but has 172.
	waitDefs(t, old, 172, cur.name+"=1400")
	waitDefs(t, old, 171)
	if st := old.c.Status(); st.Dropped[DropMalformed] != 0 || st.Dropped[DropInvalidDefinition] != 0 {
		t.Fatalf("the protocol-3 member dropped definitions: %v", st.Dropped)
	}
}

// BenchmarkDefinitions: what a pull's question about definitions costs the
// cluster with 10 and 100 members, 5 of which define the VNI (the rest
// are listed as pending): the whole list (Definitions, which a full pull
// compares) against one host's entry (DefinitionOf, which a keyed pull
// asks for each origin of its records).
func BenchmarkDefinitions(b *testing.B) {
	for _, members := range []int{10, 100} {
		s := newReplica("me")
		def := sampleDef(1450, false, 7)
		for i := range members {
			name := fmt.Sprintf("m%03d", i)
			vtep := netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
			s.memberAlive(&memberlist.Node{Name: name, Addr: vtep.AsSlice(), Port: 7947,
				Meta: encodeMeta(nodeMeta{ProtoMin: 1, ProtoMax: ProtocolIPv6, Incarnation: 1, VTEP: vtep})}, time.Unix(0, 0))
			if i < 5 {
				m := &message{Type: msgDefs, Origin: name, Incarnation: 1, AsOf: 1, Defs: []defRecord{{VNI: 7, Def: def}}}
				if reason, d := s.apply(m, time.Unix(0, 0)); reason != "" {
					b.Fatal(reason, d)
				}
			}
		}
		b.Run(fmt.Sprintf("members=%d/all", members), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if len(s.definitions(7)) != members {
					b.Fatal("wrong count")
				}
			}
		})
		b.Run(fmt.Sprintf("members=%d/one", members), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if r, ok := s.definitionOf(7, "m002", s.members["m002"]); !ok || r.Pending {
					b.Fatal("not defined")
				}
			}
		})
	}
}
