package daemon

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/overlayd/overlayd/internal/nlwrap"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

func mustAddr(t *testing.T, h *netlink.Handle, l netlink.Link, cidr string) {
	t.Helper()
	a, err := netlink.ParseAddr(cidr)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.AddrAdd(l, a); err != nil {
		t.Fatalf("address %s on %s: %v", cidr, l.Attrs().Name, err)
	}
	if err := h.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
}

// The host listener answers this host and the containers behind its
// bridges, never a machine of the underlay, one behind a gateway, or one
// behind a bridge that is the host's uplink (it carries the default route).
func TestHostClients(t *testing.T) {
	host := nstest.NewNS(t, "host")
	h := host.NL
	docker0 := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "docker0"}}
	if err := h.LinkAdd(docker0); err != nil {
		t.Fatal(err)
	}
	mustAddr(t, h, docker0, "203.0.113.1/28")
	uplink := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "eth0-peer"}
	if err := h.LinkAdd(uplink); err != nil {
		t.Fatal(err)
	}
	mustAddr(t, h, uplink, "198.51.100.1/24")
	peer, _ := h.LinkByName("eth0-peer")
	h.LinkSetUp(peer)
	if err := h.RouteAdd(&netlink.Route{LinkIndex: uplink.Attrs().Index, Gw: net.ParseIP("198.51.100.254")}); err != nil {
		t.Fatal(err)
	}
	// A VM host's uplink bridge: its own subnet, and a default route
	// through it (in a table of its own, so that the main default stays
	// on eth0 above).
	br0 := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}}
	if err := h.LinkAdd(br0); err != nil {
		t.Fatal(err)
	}
	mustAddr(t, h, br0, "192.0.2.1/24")
	if err := h.RouteAdd(&netlink.Route{LinkIndex: br0.Attrs().Index, Gw: net.ParseIP("192.0.2.254"), Priority: 500}); err != nil {
		t.Fatal(err)
	}
	hc := newHostClients(netip.MustParseAddr("169.254.53.53"), nlwrap.Wrap(h))
	for _, c := range []struct {
		addr string
		want bool
	}{
		{"127.0.0.1", true},
		{"169.254.53.53", true},
		{"203.0.113.1", true},   // the host, from its bridge address
		{"203.0.113.5", true},   // a container behind docker0
		{"198.51.100.7", false}, // the underlay
		{"203.0.113.77", false}, // behind the gateway
		{"192.0.2.9", false},    // behind the uplink bridge
		{"::1", true},
	} {
		if got := hc.allowed(netip.MustParseAddr(c.addr)); got != c.want {
			t.Errorf("client %s: allowed %v, want %v", c.addr, got, c.want)
		}
	}
}
