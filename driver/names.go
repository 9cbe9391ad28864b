package driver

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/overlayd/overlayd/internal/dnsname"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/nameindex"
)

// DefaultDNSAddress is the name server's address in every sandbox: a
// link-local address, so that it never clashes with a network's subnet and
// is never routed off the host. Containers reach it through a route Join
// hands dockerd; dockerd's embedded resolver reaches it when daemon.json
// lists it in "dns" (docs/names.md says why that is the one setting).
var DefaultDNSAddress = netip.MustParseAddr("169.254.53.53")

// NameServer serves the name server of each network whose sandbox the
// driver builds.
type NameServer interface {
	// Serve answers the queries arriving on pc (UDP) and ln (TCP) for
	// network until they are closed (the sandbox closes them when it
	// goes, or when it opens new ones). It must not block (it starts its
	// own goroutines) and must not call into the Driver: it is called
	// with the network's lock held.
	Serve(network string, pc net.PacketConn, ln net.Listener)
	// NamesChanged is told that the local endpoints or their names
	// changed (Join, Leave, SetNames), so that the names served are
	// rebuilt. It is called with a network's lock held: it must not
	// block and must not call into the Driver.
	NamesChanged()
}

// checkDNSAddress settles cfg's name server address: the default when a
// NameServer is set without one, none without a NameServer.
func checkDNSAddress(cfg *Config) error {
	if cfg.NameServer == nil {
		cfg.DNSAddress = netip.Addr{}
		return nil
	}
	if !cfg.DNSAddress.IsValid() {
		cfg.DNSAddress = DefaultDNSAddress
	}
	a := cfg.DNSAddress.Unmap()
	if !a.Is4() || a.IsUnspecified() || a.IsMulticast() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return fmt.Errorf("invalid DNS address %s: must be a unicast IPv4 address (the default %s is link-local, never routed)", cfg.DNSAddress, DefaultDNSAddress)
	}
	cfg.DNSAddress = a
	return nil
}

// claimDNSRouteLocked reports whether ep's Join gives its container the route to
// the name server: yes unless an endpoint of another network joined to
// that container holds it already (dockerd would fail to add the same
// route twice).
func (d *Driver) claimDNSRouteLocked(n *network, ep *endpoint) bool {
	if !d.cfg.DNSAddress.IsValid() || ep.sandboxKey == "" {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, held := d.dnsRoutes[ep.sandboxKey]; held {
		return false
	}
	d.dnsRoutes[ep.sandboxKey] = n.id + "/" + ep.id
	return true
}

// releaseDNSRouteLocked forgets that ep's container holds the route
// through ep.
func (d *Driver) releaseDNSRouteLocked(n *network, ep *endpoint) {
	if !ep.dnsRoute {
		return
	}
	ep.dnsRoute = false
	d.mu.Lock()
	if d.dnsRoutes[ep.sandboxKey] == n.id+"/"+ep.id {
		delete(d.dnsRoutes, ep.sandboxKey)
	}
	d.mu.Unlock()
}

// serveNamesLocked makes sure n's name server is served: its address on every
// IPv4 bridge of the sandbox and its sockets handed to the NameServer
// (once per sockets). It is level-triggered: Join, restore and every
// Reconcile call it, so a bridge stripped of the address gets it back.
// A failure is logged once per distinct error and retried by the next
// Reconcile; it never fails a Join (the network works without names).
func (d *Driver) serveNamesLocked(n *network) {
	if d.cfg.NameServer == nil || n.sb == nil || n.teardown || !n.subnets[0].pool.IsValid() {
		return
	}
	pc, ln, fresh, err := n.sb.ServeDNS(d.cfg.DNSAddress)
	if err != nil {
		if msg := err.Error(); msg != n.dnsErr {
			n.dnsErr = msg
			d.log.Warn("cannot serve the network's names; retried by the periodic reconcile", logkeys.Event, logkeys.DNSServeFailed,
				logkeys.Network, n.id, "error", err)
		}
		return
	}
	if n.dnsErr != "" {
		n.dnsErr = ""
		d.log.Info("serving the network's names again", logkeys.Event, logkeys.DNSServed, logkeys.Network, n.id)
	}
	if fresh {
		d.cfg.NameServer.Serve(n.id, pc, ln)
	}
}

// namesChangedLocked tells the name server, if any, that the names
// served may have changed (see NameServer.NamesChanged).
func (d *Driver) namesChangedLocked() {
	if d.cfg.NameServer != nil {
		d.cfg.NameServer.NamesChanged()
	}
}

// SetNames sets the DNS names of the local endpoints to what the engine
// reports now: byEndpoint maps endpoint IDs to their names as the engine
// has them; an endpoint it lacks has none. Names that are not DNS names
// are left out and logged once (as are lists over dnsname's bounds).
// Changed names are persisted and published with the endpoint's record.
// It reports whether any endpoint's names changed.
func (d *Driver) SetNames(byEndpoint map[string][]string) bool {
	changed := false
	d.eachNetwork(func(n *network) {
		for _, ep := range n.endpoints {
			packed, refused, err := dnsname.Pack(byEndpoint[ep.id])
			if packed == ep.names {
				continue
			}
			for _, r := range refused {
				d.log.Warn("a name of an endpoint is not served: not a DNS name", logkeys.Event, logkeys.NameRefused,
					logkeys.Network, n.id, "endpoint", ep.id, "error", r)
			}
			if err != nil {
				d.log.Warn("some names of an endpoint are not served", logkeys.Event, logkeys.NamesTruncated,
					logkeys.Network, n.id, "endpoint", ep.id, "error", err)
			}
			prev := ep.names
			ep.names = packed
			if err := d.saveEndpoint(n, ep); err != nil {
				ep.names = prev
				d.log.Warn("cannot persist an endpoint's names; retried with the next reading of the engine", logkeys.Network, n.id, "endpoint", ep.id, "error", err)
				continue
			}
			changed = true
			if err := d.cfg.Publisher.PublishLocalNames(n.subnets[ep.subnet].vni, ep.id, packed); err != nil {
				d.log.Warn("cannot publish an endpoint's names", logkeys.Network, n.id, "endpoint", ep.id, "error", err)
			}
		}
		if changed {
			d.namesChangedLocked()
		}
	})
	return changed
}

// LocalNames returns this host's joined endpoints for the name index:
// with their names, and with their container and network so that a
// container resolves the names of every network it is attached to.
func (d *Driver) LocalNames() []nameindex.Endpoint {
	var out []nameindex.Endpoint
	d.eachNetwork(func(n *network) {
		for _, ep := range n.endpoints {
			if !ep.joined {
				continue
			}
			container := ep.sandboxKey
			if container == "" {
				container = "endpoint:" + ep.id
			}
			out = append(out, nameindex.Endpoint{
				VNI: n.subnets[ep.subnet].vni, EndpointID: ep.id, Network: n.id, Container: container,
				IP: ep.addr.Addr(), IPv6: ep.addr6.Addr(), Names: dnsname.Unpack(ep.names),
			})
		}
	})
	return out
}
