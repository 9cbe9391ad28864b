package cluster

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/dnsname"
)

// namesAt returns what n holds of origin's endpoint id's names in vni
// ("" if none).
func namesAt(n *node, vni uint32, origin, id string) string {
	for _, e := range n.c.Names(vni) {
		if e.Origin == origin && e.EndpointID == id {
			return strings.Join(e.Names, ",")
		}
	}
	return ""
}

func waitNames(t *testing.T, n *node, vni uint32, origin, id, want string) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("%s holding names %q of %s/%s", n.name, want, origin, id), func() (bool, string) {
		got := namesAt(n, vni, origin, id)
		return got == want, got
	})
}

// TestNamesAcrossNodes: names given before and after an endpoint's record
// reach every other node with it, follow a change, and go with the record.
func TestNamesAcrossNodes(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "nm", hosts("127.0.0.", 231, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	a, b, c := nodes[0], nodes[1], nodes[2]
	const vni = 4545

	// Names before the record: kept for it.
	if err := a.c.PublishLocalNames(vni, "web", "web,web-1"); err != nil {
		t.Fatal(err)
	}
	a.publish(vni, a.peer("web", "198.51.100.2"))
	waitNames(t, b, vni, a.name, "web", "web,web-1")
	waitNames(t, c, vni, a.name, "web", "web,web-1")
	if got := namesAt(a, vni, a.name, "web"); got != "" {
		t.Fatalf("a node lists its own endpoint's names: %q", got)
	}
	// Names after the record, and a change.
	b.publish(vni, b.peer("db", "198.51.100.3"))
	if err := b.c.PublishLocalNames(vni, "db", "db"); err != nil {
		t.Fatal(err)
	}
	waitNames(t, a, vni, b.name, "db", "db")
	if err := b.c.PublishLocalNames(vni, "db", "db,postgres"); err != nil {
		t.Fatal(err)
	}
	waitNames(t, c, vni, b.name, "db", "db,postgres")
	// A names-only change leaves the peer as it was.
	if p, ok := c.c.Peer(b.key(vni, "db")); !ok || p != b.local[b.key(vni, "db")] {
		t.Fatalf("peer of db at c: %v %v", p, ok)
	}
	// Removing the names, then the record.
	if err := b.c.PublishLocalNames(vni, "db", ""); err != nil {
		t.Fatal(err)
	}
	waitNames(t, a, vni, b.name, "db", "")
	if _, ok := a.c.Peer(b.key(vni, "db")); !ok {
		t.Fatal("the record went with its names")
	}
	a.unpublish(vni, "web")
	waitNames(t, b, vni, a.name, "web", "")
	// A new record of the same key starts without the old names.
	a.publish(vni, a.peer("web", "198.51.100.2"))
	waitConverged(t, 10*time.Second, nodes)
	if got := namesAt(b, vni, a.name, "web"); got != "" {
		t.Fatalf("a deleted record's names came back: %q", got)
	}
	checkAllViolations(t, nodes)
}

// TestPublishLocalNamesRefusesBadInput: what is not in dnsname.Pack's
// form is refused with the reason, and nothing is published.
func TestPublishLocalNamesRefusesBadInput(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "nb", hosts("127.0.0.", 229, 1), nodeOpts{})
	a := nodes[0]
	for _, tc := range []struct {
		vni              uint32
		id, packed, want string
	}{
		{0, "e", "x", "VNI 0"},
		{1, "", "x", "endpoint id"},
		{1, "e", "Web", "canonical"},
		{1, "e", "b,a", "out of order"},
		{1, "e", "a,a", "repeated"},
		{1, "e", "a b", "not a letter"},
		{1, "e", strings.Repeat("a", 64), "label of 64 bytes"},
	} {
		err := a.c.PublishLocalNames(tc.vni, tc.id, tc.packed)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("PublishLocalNames(%d, %q, %q) = %v, want an error with %q", tc.vni, tc.id, tc.packed, err, tc.want)
		}
	}
}

// TestNamesWireRoundTrip: a record with names encodes and decodes to
// itself; names the decoder must refuse are refused as invalid_names.
func TestNamesWireRoundTrip(t *testing.T) {
	r := liveRec(7, "e1", "198.51.100.7", "192.0.2.1", 3)
	r.Names = "a.b,db,x_y"
	b, err := encodeMessage(&message{Type: msgDelta, Origin: "n", Incarnation: 1, Records: []record{r}})
	if err != nil {
		t.Fatal(err)
	}
	m, derr := decodeMessage(b)
	if derr != nil || len(m.Records) != 1 || m.Records[0] != r {
		t.Fatalf("decoded %+v, %v; want %+v", m, derr, r)
	}
	if recordHash(&m.Records[0]) == recordHash(&record{VNI: 7, EndpointID: "e1", IP: r.IP, MAC: r.MAC, VTEP: r.VTEP, Version: 3}) {
		t.Fatal("names do not change a record's digest hash")
	}
	for _, bad := range []string{"DB", "b,a", "a,,b", strings.Repeat("a", 64)} {
		r.Names = bad
		// Encoded by hand, past the encoder's own checks.
		b := appendHeader(nil, msgDelta, "n", 1)
		b = append(b, 1)
		b = appendRecord(b, &r)
		if _, derr := decodeMessage(b); derr == nil || derr.Reason != DropInvalidNames {
			t.Errorf("names %q: decode error %v, want %s", bad, derr, DropInvalidNames)
		}
	}
}

// TestNamesWithProtocol4Member: while a member speaks protocol 4, records
// go out without names (it would drop them) and names from it are
// dropped; once it speaks 5, the names follow.
func TestNamesWithProtocol4Member(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "np", hosts("127.0.0.", 225, 3), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	cur, peer, old := nodes[0], nodes[1], nodes[2]
	const vni = 4646
	cur.publish(vni, cur.peer("web", "198.51.100.2"))
	if err := cur.c.PublishLocalNames(vni, "web", "web"); err != nil {
		t.Fatal(err)
	}
	waitNames(t, peer, vni, cur.name, "web", "web")

	old.advertiseProtocol(ProtocolIPv6)
	waitNames(t, peer, vni, cur.name, "web", "")
	waitFor(t, 10*time.Second, "old holding web without names", func() (bool, string) {
		_, ok := old.c.Peer(cur.key(vni, "web"))
		return ok && namesAt(old, vni, cur.name, "web") == "", fmt.Sprint(ok)
	})
	// Names from the protocol-4 member are dropped, its record with them.
	before := cur.c.Status().Dropped[DropProtocol]
	if err := old.c.PublishLocalNames(vni, "olds", "olds"); err != nil {
		t.Fatal(err)
	}
	old.publish(vni, old.peer("olds", "198.51.100.9"))
	waitFor(t, 10*time.Second, "the names of the protocol-4 member dropped", func() (bool, string) {
		n := cur.c.Status().Dropped[DropProtocol]
		return n > before, fmt.Sprint(n - before)
	})
	old.unpublish(vni, "olds")

	old.advertiseProtocol(ProtocolVersion)
	waitNames(t, peer, vni, cur.name, "web", "web")
	waitNames(t, old, vni, cur.name, "web", "web")
	checkAllViolations(t, nodes)
}

// TestPackNames: Pack's canonical form, refusals and bounds.
func TestPackNames(t *testing.T) {
	packed, refused, err := dnsname.Pack([]string{"Web", "db.", "web", "bad name", "my_app.x"})
	if packed != "db,my_app.x,web" || len(refused) != 1 || err != nil {
		t.Fatalf("Pack = %q, %v, %v", packed, refused, err)
	}
	many := make([]string, 40)
	for i := range many {
		many[i] = fmt.Sprintf("n%02d", i)
	}
	packed, _, err = dnsname.Pack(many)
	if err == nil || len(dnsname.Unpack(packed)) != dnsname.MaxNames || !slices.IsSorted(dnsname.Unpack(packed)) {
		t.Fatalf("Pack of 40 = %q, %v", packed, err)
	}
	if dnsname.ValidPacked(packed) != nil {
		t.Fatalf("Pack's own output refused: %v", dnsname.ValidPacked(packed))
	}
}

// BenchmarkNamePropagation: the time from an endpoint's names and record
// being published on one node until every other node of a 10-node cluster
// (in-process, on loopback, the lan gossip profile) holds the names: what
// a container's name waits for before it resolves on every host. Each
// iteration publishes one new endpoint and withdraws it afterwards
// (untimed). Reported: p50, p99 and max over the iterations (run with
// -benchtime=200x or more for a meaningful p99).
func BenchmarkNamePropagation(b *testing.B) {
	nodes := startCluster(b, "np", hosts("127.0.0.", 91, 10), nodeOpts{})
	waitMembers(b, 30*time.Second, nodes)
	const vni = 4547
	origin := nodes[0]
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		id := fmt.Sprintf("np-%d", i)
		start := time.Now()
		if err := origin.c.PublishLocalNames(vni, id, "svc-"+id); err != nil {
			b.Fatal(err)
		}
		origin.publish(vni, origin.peer(id, "198.51.100.7"))
		for _, n := range nodes[1:] {
			for deadline := start.Add(30 * time.Second); namesAt(n, vni, origin.name, id) == ""; {
				if time.Now().After(deadline) {
					b.Fatalf("%s: names of %s not there after 30 s", n.name, id)
				}
				time.Sleep(100 * time.Microsecond) // the poll's resolution
			}
		}
		lat = append(lat, time.Since(start))
		b.StopTimer()
		origin.unpublish(vni, id)
		for _, n := range nodes[1:] {
			for namesAt(n, vni, origin.name, id) != "" {
				time.Sleep(100 * time.Microsecond)
			}
		}
		b.StartTimer()
	}
	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000 }
	b.ReportMetric(q(0.5), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
	b.ReportMetric(q(1), "max-ms")
}
