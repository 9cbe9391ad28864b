package dnsserver

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// fakeNames is a Names from a map of network/name to addresses.
type fakeNames map[string][]netip.Addr

func (f fakeNames) Lookup(network string, _ netip.Addr, name string) ([]netip.Addr, bool) {
	a, ok := f[network+"/"+name]
	return a, ok
}

var testNames = fakeNames{
	"net1/db":       {netip.MustParseAddr("10.0.0.2")},
	"net1/web":      {netip.MustParseAddr("10.0.0.3"), netip.MustParseAddr("10.0.0.4"), netip.MustParseAddr("fd00::3")},
	"net1/v6only":   {netip.MustParseAddr("fd00::9")},
	"net1/my_app.x": {netip.MustParseAddr("10.0.0.7")},
	"net1/noaddr":   nil,
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// startServer serves net1 on loopback sockets and returns their addresses.
func startServer(t testing.TB, cfg Config) (*Server, string) {
	t.Helper()
	if cfg.Names == nil {
		cfg.Names = testNames
	}
	cfg.Logger = quiet()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	pc, ln := listenPair(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, "net1", pc, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return s, pc.LocalAddr().String()
}

// listenPair opens UDP and TCP sockets on one loopback port, as a DNS
// server has (clients retry a truncated answer over TCP at the same port).
func listenPair(t testing.TB) (net.PacketConn, net.Listener) {
	t.Helper()
	for range 20 {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", pc.LocalAddr().String())
		if err == nil {
			return pc, ln
		}
		pc.Close() // the TCP port is taken: another port
	}
	t.Fatal("no loopback port free for both UDP and TCP")
	return nil, nil
}

func query(t testing.TB, netw, addr, name string, qtype uint16) *dns.Msg {
	t.Helper()
	c := &dns.Client{Net: netw, Timeout: 5 * time.Second}
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	r, _, err := c.Exchange(m, addr)
	if err != nil {
		t.Fatalf("query %s %s: %v", name, dns.TypeToString[qtype], err)
	}
	if r.Id != m.Id {
		t.Fatalf("answer ID %d, query ID %d", r.Id, m.Id)
	}
	return r
}

func addrsOf(r *dns.Msg) []string {
	var out []string
	for _, rr := range r.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			out = append(out, rr.A.String())
		case *dns.AAAA:
			out = append(out, rr.AAAA.String())
		}
	}
	return out
}

func TestClusterAnswers(t *testing.T) {
	_, addr := startServer(t, Config{})
	for _, tc := range []struct {
		name  string
		qtype uint16
		want  string
	}{
		{"db.", dns.TypeA, "10.0.0.2"},
		{"DB.", dns.TypeA, "10.0.0.2"},
		{"web.", dns.TypeA, "10.0.0.3,10.0.0.4"},
		{"web.", dns.TypeAAAA, "fd00::3"},
		{"v6only.", dns.TypeAAAA, "fd00::9"},
		{"v6only.", dns.TypeA, ""},
		{"db.", dns.TypeAAAA, ""},
		{"db.", dns.TypeMX, ""},
		{"noaddr.", dns.TypeA, ""},
		{"my_app.x.", dns.TypeA, "10.0.0.7"},
	} {
		for _, netw := range []string{"udp", "tcp"} {
			r := query(t, netw, addr, tc.name, tc.qtype)
			got := strings.Join(addrsOf(r), ",")
			if r.Rcode != dns.RcodeSuccess || got != tc.want || !r.Authoritative {
				t.Errorf("%s %s %s: rcode %s aa %v answers %q, want NOERROR aa %q", netw, tc.name, dns.TypeToString[tc.qtype],
					dns.RcodeToString[r.Rcode], r.Authoritative, got, tc.want)
			}
			for _, rr := range r.Answer {
				if rr.Header().Ttl != 0 || rr.Header().Name != tc.name {
					t.Errorf("%s: answer %v: want TTL 0 and the asked name", tc.name, rr)
				}
			}
		}
	}
}

// upstream is a test resolver on loopback: example.com A 192.0.2.1,
// big.example. with many TXT records (needs TCP), nx.example. NXDOMAIN.
type upstream struct {
	addr    netip.AddrPort
	udp     atomic.Int64
	tcp     atomic.Int64
	stall   chan struct{} // queries for slow. wait until it is closed
	started atomic.Int64
}

func startUpstream(t testing.TB) *upstream {
	t.Helper()
	u := &upstream{stall: make(chan struct{})}
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		if w.LocalAddr().Network() == "tcp" {
			u.tcp.Add(1)
		} else {
			u.udp.Add(1)
		}
		r := new(dns.Msg)
		r.SetReply(q)
		name := q.Question[0].Name
		switch name {
		case "example.com.":
			r.Answer = append(r.Answer, &dns.A{Hdr: dns.RR_Header{Name: name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.IPv4(192, 0, 2, 1)})
		case "big.example.":
			for i := range 60 {
				r.Answer = append(r.Answer, &dns.TXT{Hdr: dns.RR_Header{Name: name, Rrtype: dns.TypeTXT, Class: dns.ClassINET, Ttl: 60},
					Txt: []string{fmt.Sprintf("%02d%s", i, strings.Repeat("x", 60))}})
			}
		case "slow.example.":
			u.started.Add(1)
			<-u.stall
		default:
			r.Rcode = dns.RcodeNameError
		}
		if w.LocalAddr().Network() != "tcp" {
			size := dns.MinMsgSize
			if o := q.IsEdns0(); o != nil {
				size = int(o.UDPSize())
			}
			r.Truncate(size)
		}
		w.WriteMsg(r)
	})
	pc, ln := listenPair(t)
	u.addr = netip.MustParseAddrPort(pc.LocalAddr().String())
	us := &dns.Server{PacketConn: pc, Handler: h}
	ts := &dns.Server{Listener: ln, Handler: h}
	go us.ActivateAndServe()
	go ts.ActivateAndServe()
	t.Cleanup(func() {
		select {
		case <-u.stall:
		default:
			close(u.stall)
		}
		us.Shutdown()
		ts.Shutdown()
	})
	return u
}

func TestForward(t *testing.T) {
	u := startUpstream(t)
	_, addr := startServer(t, Config{Upstreams: func() []netip.AddrPort { return []netip.AddrPort{u.addr} }})
	for _, netw := range []string{"udp", "tcp"} {
		r := query(t, netw, addr, "example.com.", dns.TypeA)
		if got := strings.Join(addrsOf(r), ","); r.Rcode != dns.RcodeSuccess || got != "192.0.2.1" {
			t.Errorf("%s example.com: %s %q", netw, dns.RcodeToString[r.Rcode], got)
		}
		r = query(t, netw, addr, "nx.example.", dns.TypeA)
		if r.Rcode != dns.RcodeNameError {
			t.Errorf("%s nx.example: %s, want NXDOMAIN", netw, dns.RcodeToString[r.Rcode])
		}
	}
}

// TestForwardLarge: an answer larger than the upstream's UDP size is
// fetched over TCP, and cut with TC for a UDP client without EDNS0; a TCP
// client gets it whole.
func TestForwardLarge(t *testing.T) {
	u := startUpstream(t)
	_, addr := startServer(t, Config{Upstreams: func() []netip.AddrPort { return []netip.AddrPort{u.addr} }})
	c := &dns.Client{Net: "udp", Timeout: 5 * time.Second}
	m := new(dns.Msg)
	m.SetQuestion("big.example.", dns.TypeTXT)
	r, _, err := c.Exchange(m, addr)
	if err != nil {
		t.Fatal(err)
	}
	if u.tcp.Load() == 0 {
		t.Errorf("no TCP query upstream after a truncated UDP answer")
	}
	r.Compress = true // the length as sent (compressed)
	if !r.Truncated || r.Len() > dns.MinMsgSize || r.Id != m.Id {
		t.Errorf("UDP answer: TC %v, %d bytes, ID %d (want TC, <= 512, %d)", r.Truncated, r.Len(), r.Id, m.Id)
	}
	r = query(t, "tcp", addr, "big.example.", dns.TypeTXT)
	if r.Truncated || len(r.Answer) != 60 {
		t.Errorf("TCP answer: TC %v, %d answers, want 60", r.Truncated, len(r.Answer))
	}
}

func TestForwardFailures(t *testing.T) {
	// A bound UDP socket that never answers: the upstream is down.
	dead, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer dead.Close()
	deadAddr := netip.MustParseAddrPort(dead.LocalAddr().String())
	_, addr := startServer(t, Config{Timeout: 200 * time.Millisecond,
		Upstreams: func() []netip.AddrPort { return []netip.AddrPort{deadAddr} }})
	start := time.Now()
	r := query(t, "udp", addr, "example.com.", dns.TypeA)
	if took := time.Since(start); r.Rcode != dns.RcodeServerFailure || took > 2*time.Second {
		t.Errorf("upstream down: %s after %v, want SERVFAIL within the timeout", dns.RcodeToString[r.Rcode], took)
	}
	// No upstreams: SERVFAIL at once.
	_, addr = startServer(t, Config{})
	if r := query(t, "udp", addr, "example.com.", dns.TypeA); r.Rcode != dns.RcodeServerFailure {
		t.Errorf("no upstreams: %s, want SERVFAIL", dns.RcodeToString[r.Rcode])
	}
	// Upstreams are read per query: the second one answers.
	u := startUpstream(t)
	_, addr = startServer(t, Config{Timeout: 200 * time.Millisecond,
		Upstreams: func() []netip.AddrPort { return []netip.AddrPort{deadAddr, u.addr} }})
	if r := query(t, "udp", addr, "example.com.", dns.TypeA); r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
		t.Errorf("second upstream: %s %v", dns.RcodeToString[r.Rcode], r.Answer)
	}
}

func TestCodes(t *testing.T) {
	s, err := New(Config{Names: testNames, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	client := netip.MustParseAddr("127.0.0.1")
	ctx := context.Background()
	pack := func(m *dns.Msg) []byte {
		b, err := m.Pack()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	rcodeOf := func(b []byte) int {
		t.Helper()
		r := new(dns.Msg)
		if err := r.Unpack(b); err != nil {
			// A header-only answer unpacks too; anything else is a bug.
			t.Fatalf("response does not parse: %v", err)
		}
		return r.Rcode
	}

	m := new(dns.Msg)
	m.SetQuestion("db.", dns.TypeA)
	m.Question[0].Qclass = dns.ClassCHAOS
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), true)); got != dns.RcodeRefused {
		t.Errorf("class CH: %s, want REFUSED", dns.RcodeToString[got])
	}

	m = new(dns.Msg)
	m.SetQuestion("db.", dns.TypeA)
	m.Opcode = dns.OpcodeStatus
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), true)); got != dns.RcodeNotImplemented {
		t.Errorf("opcode STATUS: %s, want NOTIMP", dns.RcodeToString[got])
	}
	m.Opcode = dns.OpcodeUpdate
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), true)); got != dns.RcodeNotImplemented {
		t.Errorf("opcode UPDATE: %s, want NOTIMP", dns.RcodeToString[got])
	}

	m = new(dns.Msg)
	m.SetQuestion("db.", dns.TypeA)
	m.Question = append(m.Question, dns.Question{Name: "web.", Qtype: dns.TypeA, Qclass: dns.ClassINET})
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), true)); got != dns.RcodeFormatError {
		t.Errorf("two questions: %s, want FORMERR", dns.RcodeToString[got])
	}
	m.Question = nil
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), true)); got != dns.RcodeFormatError {
		t.Errorf("no question: %s, want FORMERR", dns.RcodeToString[got])
	}

	// Malformed: a header claiming a question that is not there.
	bad := []byte{0xab, 0xcd, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0x05, 'a'}
	resp := s.Handle(ctx, "net1", client, bad, true)
	if rcodeOf(resp) != dns.RcodeFormatError || resp[0] != 0xab || resp[1] != 0xcd {
		t.Errorf("malformed: %x, want FORMERR with ID abcd", resp)
	}
	// Shorter than a header, or an answer (QR): dropped.
	if resp := s.Handle(ctx, "net1", client, []byte{1, 2, 3}, true); resp != nil {
		t.Errorf("3 bytes: %x, want no response", resp)
	}
	m = new(dns.Msg)
	m.SetQuestion("db.", dns.TypeA)
	m.Response = true
	if resp := s.Handle(ctx, "net1", client, pack(m), true); resp != nil {
		t.Errorf("a response as request: answered, want it dropped")
	}
	// Oversized UDP: FORMERR; the same over TCP is answered.
	m = new(dns.Msg)
	m.SetQuestion("db.", dns.TypeA)
	m.SetEdns0(4096, false)
	m.IsEdns0().Option = append(m.IsEdns0().Option, &dns.EDNS0_PADDING{Padding: make([]byte, 5000)})
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), true)); got != dns.RcodeFormatError {
		t.Errorf("5 kB UDP request: %s, want FORMERR", dns.RcodeToString[got])
	}
	if got := rcodeOf(s.Handle(ctx, "net1", client, pack(m), false)); got != dns.RcodeSuccess {
		t.Errorf("5 kB TCP request: %s, want NOERROR", dns.RcodeToString[got])
	}
	// A 255-byte name (miekg refuses names over 255 octets): no panic, FORMERR.
	long := []byte{0x12, 0x34, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0}
	for range 5 {
		long = append(long, 63)
		long = append(long, []byte(strings.Repeat("a", 63))...)
	}
	long = append(long, 0, 0, 1, 0, 1)
	if got := rcodeOf(s.Handle(ctx, "net1", client, long, true)); got != dns.RcodeFormatError {
		t.Errorf("320-byte name: %s, want FORMERR", dns.RcodeToString[got])
	}
}

// TestManyAddressesTruncated: a cluster name with more addresses than fit
// 512 bytes is cut with TC over UDP and whole over TCP.
func TestManyAddressesTruncated(t *testing.T) {
	var many []netip.Addr
	for i := range 100 {
		many = append(many, netip.AddrFrom4([4]byte{10, 1, byte(i / 250), byte(i%250 + 1)}))
	}
	_, addr := startServer(t, Config{Names: fakeNames{"net1/svc": many}})
	r := query(t, "udp", addr, "svc.", dns.TypeA)
	if !r.Truncated || len(r.Answer) >= 100 {
		t.Errorf("UDP: TC %v, %d answers; want TC and fewer than 100", r.Truncated, len(r.Answer))
	}
	r = query(t, "tcp", addr, "svc.", dns.TypeA)
	if r.Truncated || len(r.Answer) != 100 {
		t.Errorf("TCP: TC %v, %d answers; want 100", r.Truncated, len(r.Answer))
	}
}

// TestMaxForwards: with MaxForwards forwards stalled upstream, one more
// forward gets SERVFAIL at once while cluster names are still answered.
func TestMaxForwards(t *testing.T) {
	u := startUpstream(t)
	const max = 4
	_, addr := startServer(t, Config{MaxForwards: max, Timeout: 10 * time.Second,
		Upstreams: func() []netip.AddrPort { return []netip.AddrPort{u.addr} }})
	var wg sync.WaitGroup
	for range max {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &dns.Client{Net: "udp", Timeout: 20 * time.Second}
			m := new(dns.Msg)
			m.SetQuestion("slow.example.", dns.TypeA)
			c.Exchange(m, addr)
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for u.started.Load() < max {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d stalled forwards reached the upstream", u.started.Load(), max)
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	r := query(t, "udp", addr, "example.com.", dns.TypeA)
	if r.Rcode != dns.RcodeServerFailure || time.Since(start) > time.Second {
		t.Errorf("forward beyond MaxForwards: %s after %v, want SERVFAIL at once", dns.RcodeToString[r.Rcode], time.Since(start))
	}
	if r := query(t, "udp", addr, "db.", dns.TypeA); len(r.Answer) != 1 {
		t.Errorf("cluster name while forwards are full: %v", r)
	}
	close(u.stall)
	wg.Wait()
	// Tokens come back: forwarding works again.
	deadline = time.Now().Add(10 * time.Second)
	for {
		r := query(t, "udp", addr, "example.com.", dns.TypeA)
		if r.Rcode == dns.RcodeSuccess {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("forwarding did not recover: %s", dns.RcodeToString[r.Rcode])
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestNew(t *testing.T) {
	if _, err := New(Config{}); err == nil {
		t.Error("New without Names: no error")
	}
	if _, err := New(Config{Names: testNames, MaxForwards: -1}); err == nil {
		t.Error("New with MaxForwards -1: no error")
	}
}
