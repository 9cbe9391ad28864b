package driver

import "sync/atomic"

// Kinds of difference Reconcile repairs (the metrics' kind label).
const (
	RepairSandbox    = "sandbox"     // what a failed Leave left: a sandbox, removed, or veths awaiting deletion, queued
	RepairBridgePort = "bridge_port" // a container link's bridge port restored
	RepairPeerEntry  = "peer_entry"  // a neighbour or FDB entry added, fixed or removed
)

// RepairKinds lists every kind, so that each is reported from zero.
var RepairKinds = []string{RepairSandbox, RepairBridgePort, RepairPeerEntry}

// counters are the driver's event counts since it started.
type counters struct {
	peerChanges atomic.Uint64 // neighbour and FDB entries programmed by the edge-triggered path
	reconciles  atomic.Uint64 // Reconcile runs
	sandbox     atomic.Uint64
	bridgePort  atomic.Uint64
	peerEntry   atomic.Uint64
}

func (c *counters) repaired(kind string, n int) {
	switch kind {
	case RepairSandbox:
		c.sandbox.Add(uint64(n))
	case RepairBridgePort:
		c.bridgePort.Add(uint64(n))
	case RepairPeerEntry:
		c.peerEntry.Add(uint64(n))
	}
}

// Counters are the driver's event counts since it started.
type Counters struct {
	// PeerChanges counts the neighbour and FDB entries set or deleted in
	// the kernel, as records changed and by Reconcile's repairs alike.
	PeerChanges uint64
	Reconciles  uint64
	// Repaired counts the differences Reconcile corrected, by kind
	// (RepairKinds).
	Repaired map[string]uint64
}

// Counters returns the driver's event counts. It takes no lock.
func (d *Driver) Counters() Counters {
	c := &d.counts
	return Counters{
		PeerChanges: c.peerChanges.Load(),
		Reconciles:  c.reconciles.Load(),
		Repaired: map[string]uint64{
			RepairSandbox:    c.sandbox.Load(),
			RepairBridgePort: c.bridgePort.Load(),
			RepairPeerEntry:  c.peerEntry.Load(),
		},
	}
}
