package driver

import (
	"net/netip"

	"github.com/overlayd/overlayd/peerdb"
)

// TraceKind says which operation a TraceEvent records.
type TraceKind int

// Kinds of trace events.
const (
	TraceCreateNetwork TraceKind = iota + 1
	TraceDeleteNetwork
	TraceCreateEndpoint
	TraceDeleteEndpoint
	TraceJoin
	TraceLeave
	TracePeerEvents // remote peer events applied to a network
	TracePending    // remote peer events kept for a VNI no network has
)

func (k TraceKind) String() string {
	switch k {
	case TraceCreateNetwork:
		return "CreateNetwork"
	case TraceDeleteNetwork:
		return "DeleteNetwork"
	case TraceCreateEndpoint:
		return "CreateEndpoint"
	case TraceDeleteEndpoint:
		return "DeleteEndpoint"
	case TraceJoin:
		return "Join"
	case TraceLeave:
		return "Leave"
	case TracePeerEvents:
		return "PeerEvents"
	case TracePending:
		return "Pending"
	}
	return "unknown"
}

// TraceEvent records one state change that succeeded, emitted while the lock
// that linearises it is held (the network's lock; driver.mu for
// TracePending; both for TraceDeleteNetwork, which returns peers to the
// pending set), so the order of trace events is the order in which the
// driver applied the changes. It exists for the stress harness's oracle.
type TraceEvent struct {
	Kind    TraceKind
	Network string
	// TraceCreateNetwork.
	VNIs      []uint32
	Pools     []netip.Prefix
	Gateways  []netip.Prefix
	MTU       int
	Internal  bool
	Encrypted bool
	// Endpoint kinds.
	Endpoint string
	Addr     netip.Prefix
	MAC      peerdb.MAC
	VTEP     netip.Addr // TraceJoin: the VTEP published for the endpoint
	// TracePeerEvents and TracePending: the valid events, in order (invalid
	// ones were rejected and changed nothing).
	VNI    uint32
	Events []peerdb.Event
}

// trace emits ev to the configured tracer; expects the linearising lock held.
func (d *Driver) trace(ev TraceEvent) {
	if d.cfg.Trace != nil {
		d.cfg.Trace(ev)
	}
}
