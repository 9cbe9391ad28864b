package nameindex

import (
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/dnsserver"
)

var _ dnsserver.Names = (*Index)(nil)

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

// The lab: networks front (VNI 10) and back (VNI 20) on this host; web
// on both, db on back only; remote endpoints on hosts b and c.
func lab() []Endpoint {
	return []Endpoint{
		{VNI: 10, EndpointID: "w1", Network: "netF", Container: "web", IP: addr("192.0.2.2"), Names: []string{"web", "site"}},
		{VNI: 20, EndpointID: "w2", Network: "netB", Container: "web", IP: addr("198.51.100.2"), IPv6: addr("2001:db8:20::2"), Names: []string{"web"}},
		{VNI: 20, EndpointID: "d1", Network: "netB", Container: "db", IP: addr("198.51.100.3"), Names: []string{"db"}},
		{VNI: 10, Host: "b", EndpointID: "w3", IP: addr("192.0.2.3"), Names: []string{"web"}},
		{VNI: 20, Host: "b", EndpointID: "c1", IP: addr("198.51.100.4"), IPv6: addr("2001:db8:20::4"), Names: []string{"cache"}},
		{VNI: 20, Host: "c", EndpointID: "s6", IPv6: addr("2001:db8:20::5"), Names: []string{"six"}},
		{VNI: 30, Host: "c", EndpointID: "x", IP: addr("203.0.113.9"), Names: []string{"other"}},
	}
}

func TestLookupScopes(t *testing.T) {
	var ix Index
	if _, ok := ix.Lookup("netF", addr("192.0.2.2"), "web"); ok {
		t.Fatal("an empty index answered")
	}
	ix.Store(Build(lab()))
	for _, tc := range []struct {
		network, client, name string
		want                  []string // nil: not found
	}{
		// web's container is on front and back: names of both.
		{"netF", "192.0.2.2", "web", []string{"192.0.2.2", "192.0.2.3", "198.51.100.2", "2001:db8:20::2"}},
		{"netB", "198.51.100.2", "db", []string{"198.51.100.3"}},
		{"netB", "2001:db8:20::2", "cache", []string{"198.51.100.4", "2001:db8:20::4"}},
		{"netF", "192.0.2.2", "six", []string{"2001:db8:20::5"}},
		// db is on back only: front's names are not its to see.
		{"netB", "198.51.100.3", "site", nil},
		{"netB", "198.51.100.3", "web", []string{"198.51.100.2", "2001:db8:20::2"}},
		// Another network's names, unknown clients, a network mismatch.
		{"netF", "192.0.2.2", "other", nil},
		{"netF", "192.0.2.99", "web", nil},
		{"netB", "192.0.2.2", "web", nil},
		{"netX", "192.0.2.2", "web", nil},
		// tasks.NAME is every holder of NAME (dockerd answers NAME
		// itself when one of its containers holds it).
		{"netB", "198.51.100.3", "tasks.web", []string{"198.51.100.2", "2001:db8:20::2"}},
		{"netB", "198.51.100.3", "tasks.site", nil},
		{"netB", "198.51.100.3", "tasks.", nil},
		// An IPv4-mapped client is the IPv4 one.
		{"netF", "::ffff:192.0.2.2", "site", []string{"192.0.2.2"}},
	} {
		got, ok := ix.Lookup(tc.network, addr(tc.client), tc.name)
		if tc.want == nil {
			if ok {
				t.Errorf("%s from %s on %s: %v, want not found", tc.name, tc.client, tc.network, got)
			}
			continue
		}
		if !ok || fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("%s from %s on %s: %v %v, want %v", tc.name, tc.client, tc.network, got, ok, tc.want)
		}
	}
}

func TestConflictsAndCounts(t *testing.T) {
	s := Build(lab())
	c := s.Conflicts()
	if len(c) != 1 || c[0].VNI != 10 || c[0].Name != "web" || !slices.Equal(c[0].Hosts, []string{"", "b"}) {
		t.Fatalf("conflicts %+v, want web of VNI 10 on this host and b", c)
	}
	if s.Names() != 7 {
		t.Fatalf("Names() = %d, want 7", s.Names())
	}
	got := s.NamesOf(20)
	if len(got) != 4 || got[0].Name != "cache" || got[3].Name != "web" {
		t.Fatalf("NamesOf(20) = %+v", got)
	}
	// Build does not depend on the order it is given.
	eps := lab()
	slices.Reverse(eps)
	r := Build(eps)
	for _, vni := range []uint32{10, 20, 30} {
		if fmt.Sprint(r.NamesOf(vni)) != fmt.Sprint(s.NamesOf(vni)) {
			t.Fatalf("VNI %d differs with the input reversed: %v vs %v", vni, r.NamesOf(vni), s.NamesOf(vni))
		}
	}
}

// bigLab: n names over nets networks, one local client per network, the
// rest remote on 10 hosts.
func bigLab(n, nets int) []Endpoint {
	eps := make([]Endpoint, 0, n)
	for i := 0; i < n; i++ {
		vni := uint32(i%nets + 1)
		e := Endpoint{VNI: vni, Host: fmt.Sprintf("h%d", i%10), EndpointID: fmt.Sprintf("e%d", i),
			IP: netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}), Names: []string{fmt.Sprintf("svc-%d", i)}}
		if i < nets {
			e.Host, e.Network, e.Container = "", fmt.Sprintf("net%d", vni), fmt.Sprintf("ctr%d", vni)
		}
		eps = append(eps, e)
	}
	return eps
}

// BenchmarkLookup: a cluster name answered from a 100k-name index over 100
// networks, with the p99 of single lookups and the memory per name.
func BenchmarkLookup(b *testing.B) {
	eps := bigLab(100000, 100)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s := Build(eps)
	runtime.GC()
	runtime.ReadMemStats(&after)
	var ix Index
	ix.Store(s)
	client := eps[7].IP // the local client of network 8
	names := make([]string, 0, 1000)
	for i := 7; len(names) < cap(names); i += 100 {
		names = append(names, eps[i].Names[0])
	}
	lat := make([]time.Duration, 0, min(b.N, 1<<20))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if _, ok := ix.Lookup("net8", client, names[i%len(names)]); !ok {
			b.Fatalf("%s not found", names[i%len(names)])
		}
		if len(lat) < cap(lat) {
			lat = append(lat, time.Since(t0))
		}
	}
	b.StopTimer()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(s.Names()), "heap-B/name")
}

// BenchmarkBuild: a snapshot of 100k names over 100 networks.
func BenchmarkBuild(b *testing.B) {
	eps := bigLab(100000, 100)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		Build(eps)
	}
}
