package dnsserver

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// BenchmarkAnswer: one cluster answer through the packet handler.
func BenchmarkAnswer(b *testing.B) {
	s, err := New(Config{Names: testNames, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	m := new(dns.Msg)
	m.SetQuestion("web.", dns.TypeA)
	req, _ := m.Pack()
	client := netip.MustParseAddr("127.0.0.1")
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if s.Handle(ctx, "net1", client, req, true) == nil {
			b.Fatal("no answer")
		}
	}
}

// BenchmarkForwardUDP: a name that is not the cluster's, over loopback
// UDP, one query in flight: asked of the upstream directly, and through
// the server (which forwards it). The difference of the p50s is what
// forwarding adds to a lookup (the budget: 0.2 ms over dockerd's own
// forwarding, which is the direct case here).
func BenchmarkForwardUDP(b *testing.B) {
	up := startUpstream(b)
	_, via := startServer(b, Config{Upstreams: func() []netip.AddrPort { return []netip.AddrPort{up.addr} }})
	for _, c := range []struct{ name, addr string }{{"direct", up.addr.String()}, {"forwarded", via}} {
		b.Run(c.name, func(b *testing.B) { benchQueries(b, c.addr, "example.com.") })
	}
}

// benchQueries asks addr for name over UDP, one query in flight, and
// reports answers/s, p50 and p99.
func benchQueries(b *testing.B, addr, name string) {
	c, err := net.Dial("udp", addr)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	m := new(dns.Msg)
	m.SetQuestion(name, dns.TypeA)
	req, _ := m.Pack()
	buf := make([]byte, 1500)
	lat := make([]time.Duration, 0, b.N)
	c.SetDeadline(time.Now().Add(time.Minute))
	start := time.Now()
	for b.Loop() {
		t0 := time.Now()
		if _, err := c.Write(req); err != nil {
			b.Fatal(err)
		}
		if _, err := c.Read(buf); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	took := time.Since(start)
	slices.Sort(lat)
	b.ReportMetric(float64(len(lat))/took.Seconds(), "answers/s")
	b.ReportMetric(lat[len(lat)/2].Seconds()*1e3, "p50_ms")
	b.ReportMetric(lat[len(lat)*99/100].Seconds()*1e3, "p99_ms")
}

// BenchmarkAnswerUDP: cluster answers over a loopback UDP socket, one
// query in flight (the latency a container sees), with answers/s and the
// p99 latency.
func BenchmarkAnswerUDP(b *testing.B) {
	_, addr := startServer(b, Config{})
	benchQueries(b, addr, "web.")
}
