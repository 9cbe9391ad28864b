package dnsserver

import (
	"context"
	"net/netip"
	"testing"

	"github.com/miekg/dns"
)

// FuzzServe feeds arbitrary bytes to the packet handler (no upstreams:
// forwards end in SERVFAIL without I/O): no panic, and every response
// parses and carries the request's ID.
func FuzzServe(f *testing.F) {
	for _, q := range []struct {
		name  string
		qtype uint16
		edns  bool
	}{
		{"db.", dns.TypeA, false}, {"web.", dns.TypeAAAA, true}, {"my_app.x.", dns.TypeA, false},
		{"example.com.", dns.TypeMX, true}, {"noaddr.", dns.TypeTXT, false},
	} {
		m := new(dns.Msg)
		m.SetQuestion(q.name, q.qtype)
		if q.edns {
			m.SetEdns0(1232, true)
		}
		b, err := m.Pack()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, true)
		f.Add(b, false)
	}
	f.Add([]byte{0xab, 0xcd, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0x05, 'a'}, true)
	s, err := New(Config{Names: testNames, Logger: quiet()})
	if err != nil {
		f.Fatal(err)
	}
	client := netip.MustParseAddr("127.0.0.1")
	f.Fuzz(func(t *testing.T, req []byte, udp bool) {
		resp := s.Handle(context.Background(), "net1", client, req, udp)
		if resp == nil {
			return
		}
		if udp && len(resp) > 65535 {
			t.Fatalf("response of %d bytes", len(resp))
		}
		r := new(dns.Msg)
		if err := r.Unpack(resp); err != nil {
			t.Fatalf("response %x does not parse: %v", resp, err)
		}
		if len(req) < 2 || r.Id != uint16(req[0])<<8|uint16(req[1]) {
			t.Fatalf("response ID %d, request %x", r.Id, req)
		}
		if !r.Response {
			t.Fatal("response without QR")
		}
	})
}
