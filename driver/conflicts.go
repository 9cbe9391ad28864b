package driver

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/peerdb"
)

// ConflictWarning is the message of the WARN line of a cross-host address
// conflict.
const ConflictWarning = "address conflict: endpoints on several hosts have the same address"

// conflictLog is what a network has said about its cross-host address
// conflicts: the conflicts it logged (by address, with their claimants) and
// how many appeared since the driver started. Guarded by network.mu.
type conflictLog struct {
	logged map[netip.Addr]string // address → claimants, as logged
	seen   int
}

// noteConflictsLocked logs every cross-host address conflict of n that appeared
// since the last call, once, at WARN, and every one that went away at INFO;
// a conflict whose claimants change is a new one. The peer table resolves
// them (a local endpoint always wins, see peerdb): this is so that the user
// learns of them, on every host involved, since each one sees its own
// endpoint win and the other host's record shadowed. The periodic reconcile
// calls it (level-triggered: a conflict is there or not, whatever the order
// its records came in).
func (d *Driver) noteConflictsLocked(n *network) {
	current := map[netip.Addr]string{}
	for _, c := range n.peers.Conflicts() {
		claimants := append([]peerdb.Peer{c.Active}, c.Shadowed...)
		if !crossHost(claimants) {
			continue
		}
		sig := fmt.Sprint(claimants)
		current[c.IP] = sig
		if n.conflicts.logged[c.IP] == sig {
			continue
		}
		n.conflicts.seen++
		vni := n.vniOf(c.IP)
		hosts := make([]string, len(claimants))
		eps := make([]string, len(claimants))
		for i, p := range claimants {
			hosts[i], eps[i] = d.hostOfLocked(vni, p), p.EndpointID
		}
		d.log.Warn(ConflictWarning, logkeys.Event, logkeys.ConflictFound, logkeys.Kind, logkeys.KindAddress,
			logkeys.Network, n.id, logkeys.VNI, vni, logkeys.Address, c.IP,
			"winner_host", hosts[0], "winner_endpoint", eps[0],
			"other_hosts", strings.Join(hosts[1:], ", "), "other_endpoints", strings.Join(eps[1:], ", "),
			"effect", "each host keeps its own endpoint with this address; the others cannot reach it",
			"remedy", "give each engine its own --subnet or --ip-range")
	}
	for ip := range n.conflicts.logged {
		if _, still := current[ip]; !still {
			d.log.Info("address conflict resolved: only one host has an endpoint with this address now",
				logkeys.Event, logkeys.ConflictResolved, logkeys.Kind, logkeys.KindAddress,
				logkeys.Network, n.id, logkeys.VNI, n.vniOf(ip), logkeys.Address, ip)
		}
	}
	n.conflicts.logged = current
}

// crossHost reports whether the claimants of an address are on more than
// one host: local entries (no VTEP) are this host's, remote ones their
// VTEP's.
func crossHost(claimants []peerdb.Peer) bool {
	return slices.ContainsFunc(claimants, func(p peerdb.Peer) bool { return p.VTEP != claimants[0].VTEP })
}

// hostOfLocked names the host of a claimant for the log: this host, or
// the origin of the record (the node name the control plane has it under)
// with its VTEP.
func (d *Driver) hostOfLocked(vni uint32, p peerdb.Peer) string {
	if !p.VTEP.IsValid() {
		return fmt.Sprintf("this host (%s)", d.VTEP())
	}
	for k, q := range d.cfg.Peers.Peers(vni) {
		if q == p {
			return fmt.Sprintf("%s (%s)", k.Origin, p.VTEP)
		}
	}
	return p.VTEP.String()
}

// vniOf returns the VNI of the subnet holding ip (0 if none).
func (n *network) vniOf(ip netip.Addr) uint32 {
	for _, s := range n.subnets {
		if s.contains(ip) {
			return s.vni
		}
	}
	return 0
}
