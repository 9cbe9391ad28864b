package driver

import (
	"net/netip"

	api "github.com/docker/go-plugins-helpers/network"
	"golang.org/x/sys/unix"
)

// The local VTEP has one owner: the driver. Where it comes from, by
// precedence:
//
//  1. the configured address (--advertise-addr): fixed;
//  2. the address swarm announces for this node (DiscoverNew with Self);
//  3. outside swarm (scope local) only, the first address of the default
//     route's device, re-read on every RefreshVTEP (a DHCP renewal that
//     changes it is followed).
//
// In swarm (scope global) without a configured address the VTEP stays
// unknown until DiscoverNew(Self): the default route's device may not be
// the interface swarm uses, and a VTEP that changes after the control plane
// started is what multi-NIC hosts suffered from.
//
// Nobody keeps a copy: local records get the VTEP when they are published,
// the control plane and the encryption state are told of every change
// (LocalPublisher.VTEPChanged) and re-derive theirs, and nothing local is ever
// refused for carrying an old VTEP.

type vtepSource int

const (
	vtepNone vtepSource = iota
	vtepRoute
	vtepDiscovered
	vtepConfigured
)

func (s vtepSource) String() string {
	switch s {
	case vtepRoute:
		return "default route"
	case vtepDiscovered:
		return "swarm (DiscoverNew)"
	case vtepConfigured:
		return "configured"
	}
	return "unknown"
}

type vtepState struct {
	addr   netip.Addr
	source vtepSource
}

// VTEP returns the local VTEP (invalid while unknown).
func (d *Driver) VTEP() netip.Addr {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.vtep.addr
}

// initVTEP settles the VTEP at New: the configured one, else (outside
// swarm) the default route's. No notification: the daemon reads VTEP after
// New.
func (d *Driver) initVTEP() {
	if d.cfg.AdvertiseAddr.IsValid() {
		d.vtep = vtepState{addr: d.cfg.AdvertiseAddr, source: vtepConfigured}
		return
	}
	if d.cfg.Scope == api.LocalScope {
		if a := d.defaultRouteAddr(); a.IsValid() {
			d.vtep = vtepState{addr: a, source: vtepRoute}
		}
	}
}

// discoveredSelf takes the address swarm announces for this node.
func (d *Driver) discoveredSelf(a netip.Addr) {
	d.setVTEP(a, vtepDiscovered)
}

// RefreshVTEP re-reads the default route's address when that is where the
// VTEP comes from (or none is known yet, outside swarm). The daemon calls
// it periodically.
func (d *Driver) RefreshVTEP() {
	d.mu.Lock()
	src := d.vtep.source
	d.mu.Unlock()
	if d.cfg.Scope != api.LocalScope || src > vtepRoute {
		return
	}
	if a := d.defaultRouteAddr(); a.IsValid() {
		d.setVTEP(a, vtepRoute)
	}
}

// setVTEP records a from source unless a source of higher precedence is in
// force, and tells the Publisher when the address changed.
func (d *Driver) setVTEP(a netip.Addr, source vtepSource) {
	d.vtepMu.Lock()
	defer d.vtepMu.Unlock()
	d.mu.Lock()
	cur := d.vtep
	if source < cur.source || (a == cur.addr && source == cur.source) {
		d.mu.Unlock()
		return
	}
	d.vtep = vtepState{addr: a, source: source}
	d.mu.Unlock()
	if a == cur.addr {
		return
	}
	if cur.addr.IsValid() {
		d.log.Warn("local VTEP changed: local endpoints are re-announced with the new address", "from", cur.addr, "to", a, "source", source)
	} else {
		d.log.Info("local VTEP settled", "vtep", a, "source", source)
	}
	d.cfg.Publisher.VTEPChanged(a)
}

// defaultRouteAddr returns the first address of the IPv4 default route's
// device (invalid if none).
func (d *Driver) defaultRouteAddr() netip.Addr {
	routes, err := d.host.Handle.RouteList(nil, unix.AF_INET)
	if err != nil {
		return netip.Addr{}
	}
	for _, r := range routes {
		if r.Dst != nil && r.Dst.IP != nil && !r.Dst.IP.IsUnspecified() {
			continue
		}
		l, err := d.host.Handle.LinkByIndex(r.LinkIndex)
		if err != nil {
			continue
		}
		addrs, err := d.host.Handle.AddrList(l, unix.AF_INET)
		if err != nil || len(addrs) == 0 {
			continue
		}
		if a, ok := netip.AddrFromSlice(addrs[0].IP); ok {
			return a.Unmap()
		}
	}
	return netip.Addr{}
}
