package daemon

import (
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/nlwrap"
)

// hostClients decides whom the host listener answers: this host's own
// processes and the containers behind its bridges, never a machine on the
// underlay (no open resolver). A client is a container of this host when
// the host reaches it directly (no gateway) through a Linux bridge
// (docker0, a user bridge, docker_gwbridge) that does not hold the host's
// own uplink address. Verdicts are cached briefly: a query costs a route
// lookup only the first time.
type hostClients struct {
	self netip.Addr
	// nl is a handle in the host's namespace (the listener's goroutines
	// may run on any thread).
	nl *nlwrap.Handle
	mu sync.Mutex // a leaf: guards cache
	// cache: per client, the verdict and when it expires.
	cache map[netip.Addr]verdict
}

type verdict struct {
	ok      bool
	expires time.Time
}

func newHostClients(self netip.Addr, nl *nlwrap.Handle) *hostClients {
	return &hostClients{self: self, nl: nl, cache: map[netip.Addr]verdict{}}
}

func (h *hostClients) allowed(a netip.Addr) bool {
	a = a.Unmap()
	now := time.Now()
	h.mu.Lock()
	v, ok := h.cache[a]
	h.mu.Unlock()
	if ok && now.Before(v.expires) {
		return v.ok
	}
	v = verdict{ok: h.check(a), expires: now.Add(clientCacheTTL)}
	h.mu.Lock()
	if len(h.cache) > 4096 { // a flood of spoofed sources must not grow it
		clear(h.cache)
	}
	h.cache[a] = v
	h.mu.Unlock()
	return v.ok
}

func (h *hostClients) check(a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	if a.IsLoopback() || a == h.self {
		return true
	}
	routes, err := h.nl.RouteGet(a.AsSlice())
	if err != nil || len(routes) == 0 {
		return false
	}
	r := routes[0]
	if r.Type == unix.RTN_LOCAL {
		return true // a process of this host, from one of its addresses
	}
	if r.Gw != nil || r.LinkIndex == 0 {
		return false
	}
	l, err := h.nl.LinkByIndex(r.LinkIndex)
	if err != nil || l.Type() != "bridge" {
		return false
	}
	// A bridge that carries the default route is the host's uplink (a
	// VM host's br0), not a container bridge.
	defs, err := h.nl.RouteListFiltered(unix.AF_INET, &netlink.Route{Dst: nil, LinkIndex: r.LinkIndex}, netlink.RT_FILTER_OIF)
	if err != nil {
		return false
	}
	for _, d := range defs {
		if d.Dst == nil || d.Dst.IP.IsUnspecified() && d.Gw != nil {
			return false
		}
	}
	return true
}

// filteredPacketConn drops datagrams from clients ok refuses: no answer,
// so no amplification either.
type filteredPacketConn struct {
	net.PacketConn
	ok func(netip.Addr) bool
}

func (f *filteredPacketConn) ReadFrom(b []byte) (int, net.Addr, error) {
	for {
		n, from, err := f.PacketConn.ReadFrom(b)
		if err != nil {
			return n, from, err
		}
		if u, isUDP := from.(*net.UDPAddr); isUDP {
			if a, ok := netip.AddrFromSlice(u.IP); ok && f.ok(a) {
				return n, from, nil
			}
		}
	}
}

// filteredListener closes connections from clients ok refuses.
type filteredListener struct {
	net.Listener
	ok func(netip.Addr) bool
}

func (f *filteredListener) Accept() (net.Conn, error) {
	for {
		c, err := f.Listener.Accept()
		if err != nil {
			return c, err
		}
		if t, isTCP := c.RemoteAddr().(*net.TCPAddr); isTCP {
			if a, ok := netip.AddrFromSlice(t.IP); ok && f.ok(a) {
				return c, nil
			}
		}
		c.Close()
	}
}
