package docker

import (
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// dnsRecorder is a DNS server in an engine's namespace that answers every
// A query for a name under .example with 192.0.2.99 (others: NXDOMAIN) and records the source of each query: where the
// engine's embedded resolver forwards from.
type dnsRecorder struct {
	pc      net.PacketConn
	mu      sync.Mutex
	sources map[string][]netip.Addr // query name -> sources
}

func newDNSRecorder(t *testing.T, e *engine, addr string) *dnsRecorder {
	t.Helper()
	fd, err := netnsutil.Socket(e.ns.h, unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a := netip.MustParseAddr(addr).As4()
	if err := unix.Bind(fd, &unix.SockaddrInet4{Port: 53, Addr: a}); err != nil {
		unix.Close(fd)
		t.Fatalf("bind %s:53 in %s: %v", addr, e.name, err)
	}
	f := os.NewFile(uintptr(fd), "dns")
	pc, err := net.FilePacketConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	r := &dnsRecorder{pc: pc, sources: map[string][]netip.Addr{}}
	t.Cleanup(func() { pc.Close() })
	go r.serve()
	return r
}

func (r *dnsRecorder) serve() {
	buf := make([]byte, 1500)
	for {
		n, from, err := r.pc.ReadFrom(buf)
		if err != nil {
			return
		}
		var q dns.Msg
		if q.Unpack(buf[:n]) != nil || len(q.Question) != 1 {
			continue
		}
		name := strings.ToLower(q.Question[0].Name)
		r.mu.Lock()
		r.sources[name] = append(r.sources[name], from.(*net.UDPAddr).AddrPort().Addr().Unmap())
		r.mu.Unlock()
		resp := new(dns.Msg)
		resp.SetReply(&q)
		if !strings.HasSuffix(name, ".example.") {
			resp.Rcode = dns.RcodeNameError
		} else if q.Question[0].Qtype == dns.TypeA {
			resp.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 0}, A: net.IPv4(192, 0, 2, 99)}}
		}
		b, _ := resp.Pack()
		r.pc.WriteTo(b, from)
	}
}

func (r *dnsRecorder) from(name string) []netip.Addr {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]netip.Addr(nil), r.sources[name]...)
}

// TestEngineDNSOrigin measures where each engine's embedded resolver sends
// a query for a name it does not know, when daemon.json's "dns" names a
// server: from the container's namespace (the source is the container's
// address) or from the host's. This decides where overlayd's name server
// must listen (docs/names.md).
//
// A measurement, not a check of overlayd: it runs only when
// OVERLAYD_MEASURE_DNS is set (its figures are in docs/names.md).
func TestEngineDNSOrigin(t *testing.T) {
	if os.Getenv("OVERLAYD_MEASURE_DNS") == "" {
		t.Skip("a measurement of the engine (docs/names.md); set OVERLAYD_MEASURE_DNS=1 to run it")
	}
	l := newLab(t)
	e := l.addEngine("h1", 1)
	lo, err := e.ns.nl.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	ll, _ := netlink.ParseAddr("169.254.53.53/32")
	if err := e.ns.nl.AddrAdd(lo, ll); err != nil {
		t.Fatal(err)
	}
	// The first two: daemon.json's "dns"; the last: no "dns", the host's
	// resolv.conf names the server.
	for i, server := range []string{"198.51.100.1", "169.254.53.53", "169.254.53.53"} {
		rec := newDNSRecorder(t, e, server)
		daemon, how := `{"dns": ["`+server+`"]}`, "daemon.json dns"
		if i == 2 {
			daemon, how = "{}", "host resolv.conf"
			if err := os.WriteFile(filepath.Join(e.dir, "resolv.conf"), []byte("nameserver "+server+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(e.dir, "daemon.json"), []byte(daemon+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		e.restartDockerd()
		e.startOverlayd("--dns-address", "off") // the recorder is the server here
		e.createNetwork("overlayd", "ov", "-o", "vni=4410", "--subnet", "192.0.2.0/26")
		e.createNetwork("overlayd", "ovint", "--internal", "-o", "vni=4411", "--subnet", "192.0.2.64/26")
		e.createNetwork("bridge", "br", "--subnet", "203.0.113.96/28")
		for _, net := range []string{"bridge", "br", "ov", "ovint"} {
			c := "c-" + net
			e.run(c, net, "")
			name := net + ".probe.example"
			start := time.Now()
			out, err := e.docker("exec", c, "nslookup", "-type=a", name)
			d := time.Since(start)
			t.Logf("engine %s server %s (%s) network %s: sources %v (%v) nslookup: %v %q",
				selected.name, server, how, net, rec.from(name+"."), d.Round(time.Millisecond), err, lastLine(out))
			e.must("rm", "-f", c)
		}
		for _, n := range []string{"ov", "ovint", "br"} {
			e.must("network", "rm", n)
		}
		if err := e.ovd.stop(); err != nil {
			t.Fatal(err)
		}
		e.ovd = nil
		rec.pc.Close()
	}
}
