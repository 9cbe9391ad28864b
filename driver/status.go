package driver

import (
	"fmt"
	"sort"

	"github.com/overlayd/overlayd/peerdb"
)

// Status is the driver's view of its networks, for `overlayd status`.
type Status struct {
	AdvertiseAddr string            `json:"advertise_addr"`
	VXLANPort     int               `json:"vxlan_port"`
	Scope         string            `json:"scope"`
	Networks      []NetworkStatus   `json:"networks"`
	PendingPeers  map[uint32]int    `json:"pending_peers,omitempty"` // remote peers kept for VNIs no local network has
	Encryption    *EncryptionStatus `json:"encryption,omitempty"`
}

// NetworkStatus describes one network.
type NetworkStatus struct {
	ID          string           `json:"id"`
	VNIs        []uint32         `json:"vnis"`
	Subnets     []string         `json:"subnets"`
	MTU         int              `json:"mtu"`
	Internal    bool             `json:"internal,omitempty"`
	Encrypted   bool             `json:"encrypted,omitempty"`
	Sandbox     string           `json:"sandbox,omitempty"` // path of the sandbox namespace, when built
	Endpoints   []EndpointStatus `json:"endpoints"`
	RemotePeers []PeerStatus     `json:"remote_peers"`
	Conflicts   []ConflictStatus `json:"conflicts,omitempty"`
}

// EndpointStatus describes a local endpoint.
type EndpointStatus struct {
	ID      string `json:"id"`
	Address string `json:"address"`
	MAC     string `json:"mac"`
	Joined  bool   `json:"joined"`
	Veth    string `json:"veth"`
}

// PeerStatus describes a remote peer record and whether it is the active
// claimant of its IP.
type PeerStatus struct {
	EndpointID string `json:"endpoint_id"`
	IP         string `json:"ip"`
	MAC        string `json:"mac"`
	VTEP       string `json:"vtep"`
	Active     bool   `json:"active"`
}

// ConflictStatus lists an IP claimed by several records.
type ConflictStatus struct {
	IP       string   `json:"ip"`
	Active   string   `json:"active"` // endpoint id of the winner
	Local    bool     `json:"active_is_local"`
	Shadowed []string `json:"shadowed"` // endpoint ids of the losers
}

// Status returns a snapshot of the driver's state. It locks each network in
// turn, never two at once.
func (d *Driver) Status() Status {
	d.mu.Lock()
	ids := make([]string, 0, len(d.nets))
	for id := range d.nets {
		ids = append(ids, id)
	}
	st := Status{VXLANPort: d.cfg.VXLANPort, Scope: d.cfg.Scope, PendingPeers: map[uint32]int{}}
	for vni, set := range d.pending {
		st.PendingPeers[vni] = len(set)
	}
	d.mu.Unlock()
	if adv := d.advertiseAddr(); adv.IsValid() {
		st.AdvertiseAddr = adv.String()
	}
	st.Encryption = d.encryptionStatus()
	sort.Strings(ids)
	for _, id := range ids {
		n, unlock, err := d.lockNetwork(id)
		if err != nil {
			continue
		}
		st.Networks = append(st.Networks, n.status())
		unlock()
	}
	return st
}

// status expects n.mu held.
func (n *network) status() NetworkStatus {
	ns := NetworkStatus{ID: n.id, VNIs: n.vnis(), MTU: n.mtu, Internal: n.internal, Encrypted: n.encrypted, Endpoints: []EndpointStatus{}, RemotePeers: []PeerStatus{}}
	for _, s := range n.subnets {
		ns.Subnets = append(ns.Subnets, s.pool.String())
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
		ns.Endpoints = append(ns.Endpoints, EndpointStatus{ID: ep.id, Address: ep.addr.String(), MAC: ep.mac.String(), Joined: ep.joined, Veth: ep.hostName})
	}
	for _, p := range n.peers.Remote() {
		act, local, ok := n.peers.Active(p.IP)
		ns.RemotePeers = append(ns.RemotePeers, PeerStatus{EndpointID: p.EndpointID, IP: p.IP.String(), MAC: p.MAC.String(),
			VTEP: p.VTEP.String(), Active: ok && !local && act == p})
	}
	for _, c := range n.peers.Conflicts() {
		cs := ConflictStatus{IP: c.IP.String(), Active: c.Active.EndpointID, Local: c.ActiveLocal}
		for _, s := range c.Shadowed {
			cs.Shadowed = append(cs.Shadowed, s.EndpointID)
		}
		ns.Conflicts = append(ns.Conflicts, cs)
	}
	return ns
}

// String renders a network for humans.
func (ns NetworkStatus) String() string {
	return fmt.Sprintf("%s vni=%v subnets=%v mtu=%d endpoints=%d remote=%d", ns.ID, ns.VNIs, ns.Subnets, ns.MTU, len(ns.Endpoints), len(ns.RemotePeers))
}

// ForEachLocalPeer calls fn with the record of every joined local endpoint,
// holding that endpoint's network lock during the call, so that a
// republication is ordered with the Join/Leave publications of the same
// network (fn must not block nor call into the Driver, like a
// PeerPublisher).
func (d *Driver) ForEachLocalPeer(fn func(vni uint32, p peerdb.Peer)) {
	d.mu.Lock()
	nets := make([]*network, 0, len(d.nets))
	for _, n := range d.nets {
		nets = append(nets, n)
	}
	d.mu.Unlock()
	for _, n := range nets {
		n.mu.Lock()
		if !n.deleted {
			for _, ep := range n.endpoints {
				if ep.joined {
					fn(n.subnets[ep.subnet].vni, ep.peer(ep.vtep))
				}
			}
		}
		n.mu.Unlock()
	}
}
