package cluster

import (
	"bytes"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/peerdb"
)

// Tests of IPv6 addresses in peer records (protocol 4, issue 12).

// TestRecordWithoutIPv6EncodesAsProtocol3: a record without an IPv6
// address is, byte for byte, the protocol-3 record (a node of protocol 3
// decodes it), and its digest contribution is unchanged.
func TestRecordWithoutIPv6EncodesAsProtocol3(t *testing.T) {
	r := liveRec(300, "ep", "10.0.0.2", "192.168.0.1", 5)
	mac := peerdb.MACFromIP(r.IP)
	want := []byte{0x00, 0x01, 0x2c, 0, 2, 'e', 'p', 5, 10, 0, 0, 2}
	want = append(want, mac[:]...)
	want = append(want, 4, 192, 168, 0, 1)
	if got := appendRecord(nil, &r); !bytes.Equal(got, want) {
		t.Fatalf("record without IPv6 encodes as %x, protocol 3 is %x", got, want)
	}
	if recordSize(&r) != len(want) {
		t.Fatalf("recordSize %d, encoded %d", recordSize(&r), len(want))
	}
	// The protocol-3 hash: FNV-1a over VNI, id length and id, version,
	// IP, MAC, VTEP as 16 bytes.
	h3 := fnv.New64a()
	vtep16 := r.VTEP.As16()
	h3.Write(slices.Concat([]byte{0, 0, 1, 0x2c, 2, 'e', 'p'}, []byte{0, 0, 0, 0, 0, 0, 0, 5}, []byte{10, 0, 0, 2}, mac[:], vtep16[:]))
	if h := recordHash(&r); h != h3.Sum64() {
		t.Fatalf("hash %#x, protocol 3 gives %#x", h, h3.Sum64())
	}
	d := dualRec(300, "ep", "10.0.0.2", "2001:db8::2", "192.168.0.1", 5)
	if recordHash(&d) == recordHash(&r) {
		t.Fatal("the IPv6 address does not change the digest contribution")
	}
	b := appendRecord(nil, &d)
	if b[3]&flagIPv6 == 0 || b[3]&flagNoIPv4 != 0 || len(b) != recordSize(&d) || len(b) != len(want)+16 {
		t.Fatalf("dual-stack record %x (flags %#x, %d bytes, size %d)", b, b[3], len(b), recordSize(&d))
	}
	v6 := dualRec(300, "ep", "", "2001:db8::2", "192.168.0.1", 5)
	if b := appendRecord(nil, &v6); b[3]&(flagIPv6|flagNoIPv4) != flagIPv6|flagNoIPv4 || len(b) != len(want)+12 || len(b) != recordSize(&v6) {
		t.Fatalf("IPv6-only record %x", b)
	}
}

// TestLocalStoreWithholdsIPv6: while a member of an older protocol is
// alive, the local records go out without their IPv6 addresses (IPv6-only
// ones withdrawn); digest counts and hashes always match the published
// records; once every member speaks protocol 4, everything goes out in
// full again, with new versions.
func TestLocalStoreWithholdsIPv6(t *testing.T) {
	vtep := netip.MustParseAddr("192.0.2.1")
	l := newLocalStore("n", 1, vtep, time.Now)
	peer := func(id, ip, ip6 string) *peerdb.Peer {
		p := &peerdb.Peer{EndpointID: id, MAC: peerdb.MAC{2, 0, 0, 0, 0, byte(len(id))}, VTEP: vtep}
		if ip != "" {
			p.IP = netip.MustParseAddr(ip)
		}
		if ip6 != "" {
			p.IPv6 = netip.MustParseAddr(ip6)
		}
		return p
	}
	dual, only6, only4 := peer("d", "198.51.100.2", "2001:db8::2"), peer("six", "", "2001:db8::3"), peer("four", "198.51.100.4", "")
	for _, p := range []*peerdb.Peer{dual, only6, only4} {
		if reason, _ := l.publish(100, nil, p); reason != "" {
			t.Fatalf("publish %v: %s", p, reason)
		}
	}
	published := func() map[string]record {
		m := l.snapshot()
		out := map[string]record{}
		for _, r := range m.Records {
			out[r.EndpointID] = r
		}
		// The digest summarises exactly what the snapshot holds.
		var h uint64
		for _, r := range m.Records {
			h += recordHash(&r)
		}
		if d := l.digest(); d.Count != uint64(len(m.Records)) || d.Hash != h {
			t.Fatalf("digest %d/%#x, snapshot %d/%#x", d.Count, d.Hash, len(m.Records), h)
		}
		return out
	}
	if got := published(); len(got) != 3 || got["d"].IPv6 != dual.IPv6 || got["six"].IPv6 != only6.IPv6 {
		t.Fatalf("all speak 4: published %v", got)
	}
	l.takeDirty()

	// A protocol-3 member appears.
	if changed, n := l.setIPv6(false); !changed || n != 2 {
		t.Fatalf("setIPv6(false) = %v, %d", changed, n)
	}
	got := published()
	four := got["four"]
	if len(got) != 2 || got["d"].IPv6.IsValid() || got["d"].IP != dual.IP || four.peer() != *only4 {
		t.Fatalf("withheld: published %v", got)
	}
	dirty := l.takeDirty()
	slices.SortFunc(dirty, func(a, b record) int { return bytes.Compare([]byte(a.EndpointID), []byte(b.EndpointID)) })
	if len(dirty) != 2 || dirty[0].EndpointID != "d" || dirty[1].EndpointID != "six" || !dirty[1].Deleted {
		t.Fatalf("re-published %+v, want d without IPv6 and six withdrawn", dirty)
	}
	for _, r := range dirty {
		if r.hasIPv6() {
			t.Fatalf("re-published %+v with its IPv6 address", r)
		}
	}
	if ok, n := l.ipv6State(); ok || n != 2 {
		t.Fatalf("ipv6State = %v, %d", ok, n)
	}
	// Withheld records are still the driver's: publishing them again is
	// a no-op, they survive the tombstone reaper and a VTEP change.
	if _, changed := l.publish(100, only6, only6); changed {
		t.Fatal("publishing a withheld record again changed something")
	}
	l.reap(time.Now().Add(time.Hour), time.Second)
	vtep2 := netip.MustParseAddr("192.0.2.2")
	l.setVTEP(vtep2)
	l.takeDirty()
	// A new dual-stack record goes out without its IPv6 address.
	late := peer("late", "198.51.100.5", "2001:db8::5")
	late.VTEP = vtep2
	l.publish(100, nil, late)
	if d := l.takeDirty(); len(d) != 1 || d[0].hasIPv6() || d[0].IP != late.IP {
		t.Fatalf("new record while withheld: %+v", d)
	}

	// Every member speaks 4 again: all go out in full, with new versions.
	before := published()
	if changed, n := l.setIPv6(true); !changed || n != 3 {
		t.Fatalf("setIPv6(true) = %v, %d", changed, n)
	}
	got = published()
	for id, ip6 := range map[string]string{"d": "2001:db8::2", "six": "2001:db8::3", "late": "2001:db8::5"} {
		r := got[id]
		if r.IPv6 != netip.MustParseAddr(ip6) || r.VTEP != vtep2 || r.Version <= before[id].Version {
			t.Fatalf("%s after the upgrade: %+v (before %+v)", id, r, before[id])
		}
	}
	if ok, n := l.ipv6State(); !ok || n != 0 {
		t.Fatalf("ipv6State = %v, %d", ok, n)
	}
	// Unpublishing a withheld IPv6-only record withdraws it.
	l.setIPv6(false)
	l.takeDirty()
	if _, changed := l.publish(100, only6, nil); !changed {
		t.Fatal("unpublishing a withheld record changed nothing")
	}
	if _, n := l.ipv6State(); n != 2 {
		t.Fatalf("%d withheld after the withdrawal, want 2", n)
	}
	l.setIPv6(true)
	if got := published(); got["six"].EndpointID != "" {
		t.Fatalf("withdrawn record came back: %+v", got["six"])
	}
}

// TestDestNeverGetsIPv6BelowProtocol4: a sender to a member of an older
// protocol turns deltas with IPv6 records into a snapshot, which it sends
// without them.
func TestDestNeverGetsIPv6BelowProtocol4(t *testing.T) {
	d := newDest(&memberlist.Node{Name: "three"})
	d.proto = 3
	d.enqueue([][]byte{{1}}, protocolVersionMin)
	d.enqueue([][]byte{{2}}, ProtocolIPv6)
	if !d.snapshot || len(d.queue) != 0 {
		t.Fatalf("protocol-3 member: queue %v snapshot %v", d.queue, d.snapshot)
	}
	d = newDest(&memberlist.Node{Name: "four"})
	d.proto = ProtocolIPv6
	d.enqueue([][]byte{{2}}, ProtocolIPv6)
	if d.snapshot || len(d.queue) != 1 {
		t.Fatalf("protocol-4 member: queue %v snapshot %v", d.queue, d.snapshot)
	}
	recs := []record{
		dualRec(1, "d", "10.0.0.2", "2001:db8::2", "192.0.2.1", 1),
		dualRec(1, "six", "", "2001:db8::3", "192.0.2.1", 1),
		liveRec(1, "four", "10.0.0.4", "192.0.2.1", 1),
	}
	got := downgrade(recs, 3)
	if len(got) != 2 || got[0].EndpointID != "d" || got[0].IPv6.IsValid() || got[1].EndpointID != "four" {
		t.Fatalf("downgrade to 3 = %+v", got)
	}
}

// TestIPv6RecordsAcrossNodes: a dual-stack and an IPv6-only record go from
// one node to another and land in the receiver's peer table as IPv6
// neighbour entries beside the IPv4 one, with one FDB entry per MAC.
func TestIPv6RecordsAcrossNodes(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "v6n", hosts("127.0.0.", 251, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	a, b := nodes[0], nodes[1]
	const vni = 4242
	ip, ip6, only6 := netip.MustParseAddr("198.51.100.2"), netip.MustParseAddr("2001:db8:1::2"), netip.MustParseAddr("2001:db8:1::3")
	dual := peerdb.Peer{EndpointID: "dual", IP: ip, IPv6: ip6, MAC: peerdb.MAC{2, 0x42, 0, 0, 0, 2}, VTEP: a.vtep}
	six := peerdb.Peer{EndpointID: "six", IPv6: only6, MAC: peerdb.MAC{2, 0x42, 0, 0, 0, 3}, VTEP: a.vtep}
	a.publish(vni, dual)
	a.publish(vni, six)
	waitConverged(t, 10*time.Second, nodes)

	db := peerdb.NewSegments([]peerdb.Segment{{VNI: vni,
		Prefixes: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24"), netip.MustParsePrefix("2001:db8:1::/64")}}})
	keys := []peerdb.Key{a.key(vni, "dual"), a.key(vni, "six")}
	_, rej := db.Pull(vni, keys, func(i int) (peerdb.Peer, bool) { return b.c.Peer(keys[i]) })
	if len(rej) != 0 {
		t.Fatalf("rejected %v", rej)
	}
	want := map[peerdb.NeighKey]peerdb.MAC{{IP: ip}: dual.MAC, {IP: ip6}: dual.MAC, {IP: only6}: six.MAC}
	st := db.Desired()
	if fmt.Sprint(st.Neigh) != fmt.Sprint(want) || len(st.FDB) != 2 || st.FDB[peerdb.FDBKey{MAC: dual.MAC}] != a.vtep {
		t.Fatalf("desired state %+v, want neighbours %v and two FDB entries to %s", st, want, a.vtep)
	}

	// The IPv6-only endpoint moves to another address; the dual-stack one
	// goes.
	moved := six
	moved.IPv6 = netip.MustParseAddr("2001:db8:1::4")
	a.publish(vni, moved)
	a.unpublish(vni, "dual")
	waitConverged(t, 10*time.Second, nodes)
	d, _ := db.Pull(vni, keys, func(i int) (peerdb.Peer, bool) { return b.c.Peer(keys[i]) })
	if len(d.NeighDel) != 3 || len(d.NeighSet) != 1 || d.NeighSet[0].IP != moved.IPv6 {
		t.Fatalf("after the move: delta %+v", d)
	}
	checkAllViolations(t, nodes)
}

// TestIPv6WithProtocol3Member: while a member speaks protocol 3, the
// others' records reach it (and everyone) without their IPv6 addresses,
// the status says why, and records with IPv6 from a protocol-3 origin are
// dropped; when it speaks 4, the full records follow.
func TestIPv6WithProtocol3Member(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "v6p", hosts("127.0.0.", 246, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	cur, peer4, old := nodes[0], nodes[1], nodes[2]
	const vni = 4343
	mk := func(id, ip, ip6 string) peerdb.Peer {
		p := peerdb.Peer{EndpointID: id, MAC: peerdb.MAC{2, 0x42, 0, 0, 0, byte(len(id))}, VTEP: cur.vtep}
		if ip != "" {
			p.IP = netip.MustParseAddr(ip)
		}
		p.IPv6 = netip.MustParseAddr(ip6)
		return p
	}
	dual, six := mk("dual", "198.51.100.2", "2001:db8:1::2"), mk("sixsix", "", "2001:db8:1::3")
	cur.publish(vni, dual)
	cur.publish(vni, six)
	waitConverged(t, 10*time.Second, nodes)

	old.advertiseProtocol(3)
	// What every other node should hold of cur's while old speaks 3.
	v4only := dual
	v4only.IPv6 = netip.Addr{}
	withheld := map[peerdb.Key]peerdb.Peer{cur.key(vni, "dual"): v4only}
	for _, n := range []*node{peer4, old} {
		waitFor(t, 10*time.Second, n.name+" holding cur's records without IPv6", func() (bool, string) {
			if d := diffState(inForce(n, map[uint32]bool{vni: true}), withheld); d != "" {
				return false, d
			}
			return true, ""
		})
	}
	st := cur.c.Status().Node.IPv6Withheld
	if st == nil || st.Records != 2 || !slices.Equal(st.Members, []string{old.name}) {
		t.Fatalf("status: IPv6Withheld %+v, want 2 records because of %s", st, old.name)
	}
	// A record published meanwhile reaches old without its IPv6 address.
	late := mk("late", "198.51.100.5", "2001:db8:1::5")
	cur.publish(vni, late)
	lateV4 := late
	lateV4.IPv6 = netip.Addr{}
	waitFor(t, 10*time.Second, "the late record at "+old.name, func() (bool, string) {
		p, ok := old.c.Peer(cur.key(vni, "late"))
		return ok && p == lateV4, fmt.Sprint(p, ok)
	})

	// A record with IPv6 from the protocol-3 member is dropped.
	before := cur.c.Status().Dropped[DropProtocol]
	old.publish(vni, peerdb.Peer{EndpointID: "from-old", IP: netip.MustParseAddr("198.51.100.9"),
		IPv6: netip.MustParseAddr("2001:db8:1::9"), MAC: peerdb.MAC{2, 0x42, 0, 0, 0, 9}, VTEP: old.vtep})
	waitFor(t, 10*time.Second, "the IPv6 record of the protocol-3 member dropped", func() (bool, string) {
		n := cur.c.Status().Dropped[DropProtocol]
		return n > before, fmt.Sprint(n - before)
	})
	if _, ok := cur.c.Peer(old.key(vni, "from-old")); ok {
		t.Fatal("a record with IPv6 from a protocol-3 origin is in force")
	}
	old.unpublish(vni, "from-old")

	// old is upgraded: everything goes out in full again.
	old.advertiseProtocol(ProtocolVersion)
	waitConverged(t, 10*time.Second, nodes)
	if st := cur.c.Status().Node.IPv6Withheld; st != nil {
		t.Fatalf("status still says IPv6 is withheld: %+v", st)
	}
	checkAllViolations(t, nodes)
}
