package driver

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/peerdb"
)

// Status is the driver's view of its networks, for `overlayd status`.
type Status struct {
	AdvertiseAddr string             `json:"advertise_addr"`
	VXLANPort     int                `json:"vxlan_port"`
	Scope         string             `json:"scope"`
	VTEPSource    string             `json:"vtep_source"` // configured, swarm (DiscoverNew), default route, or unknown
	Networks      []NetworkStatus    `json:"networks"`
	Encryption    *encryption.Status `json:"encryption,omitempty"`
}

// NetworkStatus describes one network.
type NetworkStatus struct {
	ID          string           `json:"id"`
	VNIs        []uint32         `json:"vnis"`
	Subnets     []string         `json:"subnets"` // of both families; a network with IPv6 has one VNI for all
	MTU         int              `json:"mtu"`
	Internal    bool             `json:"internal,omitempty"`
	Encrypted   bool             `json:"encrypted,omitempty"`
	Sandbox     string           `json:"sandbox,omitempty"` // path of the sandbox namespace, when built
	Endpoints   []EndpointStatus `json:"endpoints"`
	RemotePeers []PeerStatus     `json:"remote_peers"`
	Conflicts   []ConflictStatus `json:"conflicts,omitempty"`
	// ConflictsSeen counts the cross-host address conflicts that appeared
	// since the start (each is logged once at WARN when the periodic
	// reconcile finds it).
	ConflictsSeen int `json:"conflicts_seen,omitempty"`
	// Rejected are records the control plane has in force for the
	// network's VNIs that it does not hold (invalid, or outside the subnet
	// of their VNI), with the reason.
	Rejected []RejectedStatus `json:"rejected,omitempty"`
	// DefinitionConflicts are other hosts whose definition of one of the
	// network's VNIs contradicts the network's (their records of that VNI
	// are refused).
	DefinitionConflicts []DefinitionConflictStatus `json:"definition_conflicts,omitempty"`
	// Error is the last kernel programming error of the network's peers
	// (the periodic reconcile retries), or the sandbox left to remove.
	Error string `json:"error,omitempty"`
}

// RejectedStatus is one refused remote record.
type RejectedStatus struct {
	VNI        uint32 `json:"vni"`
	Origin     string `json:"origin"`
	EndpointID string `json:"endpoint_id"`
	Reason     string `json:"reason"`
}

// EndpointStatus describes a local endpoint.
type EndpointStatus struct {
	ID      string `json:"id"`
	VNI     uint32 `json:"vni"`     // of its subnet
	Address string `json:"address"` // IPv4; "" for an endpoint of an IPv6-only network
	// AddressIPv6 is its IPv6 address, absent when it has none.
	AddressIPv6 string `json:"address_ipv6,omitempty"`
	MAC         string `json:"mac"`
	Joined      bool   `json:"joined"`
	Veth        string `json:"veth"`
}

// PeerStatus describes a remote peer record and whether it is the active
// claimant of its IP.
type PeerStatus struct {
	EndpointID string `json:"endpoint_id"`
	VNI        uint32 `json:"vni"` // of the subnet holding its IP
	IP         string `json:"ip"`  // IPv4; "" when it has none
	MAC        string `json:"mac"`
	VTEP       string `json:"vtep"`
	Active     bool   `json:"active"` // the active claimant of IP
	// IPv6 is its IPv6 address, absent when it has none; ActiveIPv6 says
	// whether it is the active claimant of it (each address is a claim of
	// its own).
	IPv6       string `json:"ipv6,omitempty"`
	ActiveIPv6 bool   `json:"active_ipv6,omitempty"`
}

// ConflictStatus lists an IP claimed by several records.
type ConflictStatus struct {
	IP       string   `json:"ip"`
	VNI      uint32   `json:"vni"`
	Active   string   `json:"active"` // endpoint id of the winner
	Local    bool     `json:"active_is_local"`
	Shadowed []string `json:"shadowed"` // endpoint ids of the losers
}

// Status returns a snapshot of the driver's state. It locks each network in
// turn, never two at once.
func (d *Driver) Status() Status {
	d.mu.Lock()
	st := Status{VXLANPort: d.cfg.VXLANPort, Scope: d.cfg.Scope, VTEPSource: d.vtep.source.String()}
	if d.vtep.addr.IsValid() {
		st.AdvertiseAddr = d.vtep.addr.String()
	}
	d.mu.Unlock()
	st.Encryption = d.encryptionStatus()
	d.eachNetwork(func(n *network) {
		ns := n.statusLocked()
		ns.DefinitionConflicts = d.definitionStatusLocked(n)
		st.Networks = append(st.Networks, ns)
	})
	return st
}

// statusLocked describes n for Status.
func (n *network) statusLocked() NetworkStatus {
	ns := NetworkStatus{ID: n.id, VNIs: n.vnis(), MTU: n.mtu, Internal: n.internal, Encrypted: n.encrypted, Endpoints: []EndpointStatus{}, RemotePeers: []PeerStatus{},
		ConflictsSeen: n.conflicts.seen}
	for _, p := range n.pools() {
		ns.Subnets = append(ns.Subnets, p.String())
	}
	if n.sb != nil {
		ns.Sandbox = n.sb.Path()
	}
	epIDs := make([]string, 0, len(n.endpoints))
	for id := range n.endpoints {
		epIDs = append(epIDs, id)
	}
	sort.Strings(epIDs)
	for _, id := range epIDs {
		ep := n.endpoints[id]
		ns.Endpoints = append(ns.Endpoints, EndpointStatus{ID: ep.id, VNI: n.subnets[ep.subnet].vni, Address: prefixString(ep.addr), AddressIPv6: prefixString(ep.addr6),
			MAC: ep.mac.String(), Joined: ep.joined, Veth: ep.hostName})
	}
	for _, p := range n.peers.Remote() {
		ps := PeerStatus{EndpointID: p.EndpointID, MAC: p.MAC.String(), VTEP: p.VTEP.String()}
		if p.IP.IsValid() {
			ps.VNI, ps.IP, ps.Active = n.vniOf(p.IP), p.IP.String(), n.activeForLocked(p.IP, p)
		}
		if p.IPv6.IsValid() {
			ps.VNI, ps.IPv6, ps.ActiveIPv6 = n.vniOf(p.IPv6), p.IPv6.String(), n.activeForLocked(p.IPv6, p)
		}
		ns.RemotePeers = append(ns.RemotePeers, ps)
	}
	for _, r := range n.peers.Rejected() {
		ns.Rejected = append(ns.Rejected, RejectedStatus{VNI: r.Key.VNI, Origin: r.Key.Origin, EndpointID: r.Key.EndpointID, Reason: r.Err.Error()})
	}
	switch {
	case n.teardown || n.teardownFailedLocked():
		ns.Error = "the sandbox of the last Leave could not be removed; retrying"
	case n.lastErr != nil:
		ns.Error = n.lastErr.Error()
	}
	for _, c := range n.peers.Conflicts() {
		cs := ConflictStatus{IP: c.IP.String(), VNI: n.vniOf(c.IP), Active: c.Active.EndpointID, Local: c.ActiveLocal}
		for _, s := range c.Shadowed {
			cs.Shadowed = append(cs.Shadowed, s.EndpointID)
		}
		ns.Conflicts = append(ns.Conflicts, cs)
	}
	return ns
}

// activeForLocked reports whether remote record p is the active claimant
// of its address ip.
func (n *network) activeForLocked(ip netip.Addr, p peerdb.Peer) bool {
	act, local, ok := n.peers.Active(ip)
	return ok && !local && act == p
}

// String renders a network for humans.
func (ns NetworkStatus) String() string {
	return fmt.Sprintf("%s vni=%v subnets=%v mtu=%d endpoints=%d remote=%d", ns.ID, ns.VNIs, ns.Subnets, ns.MTU, len(ns.Endpoints), len(ns.RemotePeers))
}

// LocalPeers returns the record of every joined local endpoint, by VNI,
// without VTEP (the control plane stamps the one it advertises). Each
// network is read under its lock, so the list is consistent per network;
// the daemon hands it to the control plane at start and periodically,
// which makes the published records exactly these.
func (d *Driver) LocalPeers() []LocalRecord {
	var out []LocalRecord
	d.eachNetwork(func(n *network) {
		for _, ep := range n.endpoints {
			if ep.joined {
				out = append(out, LocalRecord{VNI: n.subnets[ep.subnet].vni, Peer: ep.peer(), Names: ep.names})
			}
		}
	})
	slices.SortFunc(out, func(a, b LocalRecord) int {
		return cmp.Or(cmp.Compare(a.VNI, b.VNI), strings.Compare(a.Peer.EndpointID, b.Peer.EndpointID))
	})
	return out
}

// LocalRecord is one joined local endpoint's record and its VNI.
type LocalRecord struct {
	VNI  uint32
	Peer peerdb.Peer
	// Names: the endpoint's DNS names, packed (internal/dnsname); "" for none.
	Names string
}
