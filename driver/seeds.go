package driver

import (
	"fmt"
	"net/netip"
	"strings"
)

// Gossip seeds in a swarm network's options (OptSeeds).
//
// In a swarm that exists before the plugin is enabled, dockerd announces
// no other node to it (DiscoverNew comes only for this node), so nothing
// would tell the nodes' control planes of each other. The swarm leader's
// AllocateNetwork answer is what dockerd hands to every node's
// CreateNetwork: the leader puts its gossip address and the members it
// knows there (Membership.GossipSeeds), and each node hands them to its
// control plane (Membership.AddSeeds), which joins them unless it is in a
// cluster with them already.

// parseSeeds validates the value of OptSeeds: a comma-separated list of
// IP:port gossip addresses.
func parseSeeds(val string) ([]string, error) {
	if strings.TrimSpace(val) == "" {
		return nil, fmt.Errorf("option %s is empty: give the gossip addresses to join as IP:port (like 192.0.2.1:7947), comma-separated, or leave the option out", OptSeeds)
	}
	var seeds []string
	for _, f := range strings.Split(val, ",") {
		f = strings.TrimSpace(f)
		ap, err := netip.ParseAddrPort(f)
		if a := ap.Addr().Unmap(); err != nil || ap.Port() == 0 || !(a.IsGlobalUnicast() || a.IsLoopback()) {
			return nil, fmt.Errorf("option %s=%q: %q is not a gossip address: each entry must be a unicast IP address and a port in 1..65535 (like 192.0.2.1:7947 or [2001:db8::1]:7947), comma-separated", OptSeeds, val, f)
		}
		seeds = append(seeds, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String())
	}
	return seeds, nil
}

// seedsOption returns the seeds a network's options carry (nil if none).
func seedsOption(opts map[string]string) ([]string, error) {
	val, ok := opts[OptSeeds]
	if !ok {
		return nil, nil
	}
	return parseSeeds(val)
}

// allocSeeds returns the OptSeeds value for the AllocateNetwork answer of
// network id whose request options are given: this node's gossip address
// and the members it knows, fresh (a leader restart re-sends its previous
// answer: its seeds are replaced, not added to, so that re-allocation is
// idempotent). Without a control plane yet, the given value is kept (the
// previous answer's), or the network carries none. Called without driver
// locks held: GossipSeeds may wait briefly for the control plane.
func (d *Driver) allocSeeds(id string, given map[string]string) (string, bool, error) {
	old, had := given[OptSeeds]
	if had {
		if _, err := parseSeeds(old); err != nil {
			return "", false, err
		}
	}
	if fresh := d.cfg.Membership.GossipSeeds(); len(fresh) > 0 {
		return strings.Join(fresh, ","), true, nil
	}
	if had {
		d.log.Info("AllocateNetwork: the control plane has not started yet; keeping the gossip seeds the network carried",
			"network", id, "seeds", old)
		return old, true, nil
	}
	d.log.Warn("AllocateNetwork: the control plane has not started yet (this node's address is not known), so the network carries no gossip seeds: "+
		"nodes whose plugin is enabled after the swarm formed find the others only through OVERLAYD_JOIN or the members they remember",
		"network", id)
	return "", false, nil
}

// handRestoredSeeds gives the control plane the seeds of the networks
// restored from the state file, so that a plugin restarted in a swarm
// (which dockerd tells of no other node) finds the cluster even if it had
// no time to remember its members. Called from New, before the driver is
// shared.
func (d *Driver) handRestoredSeeds() {
	for _, id := range sortedKeys(d.nets) {
		seeds, err := seedsOption(d.nets[id].options)
		if err != nil {
			d.log.Warn("ignoring the gossip seeds of a restored network", "network", id, "error", err)
			continue
		}
		if len(seeds) > 0 {
			d.cfg.Membership.AddSeeds(seeds)
		}
	}
}
