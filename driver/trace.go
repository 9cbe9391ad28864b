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
	TracePull // a network pulled remote records of one VNI from the source
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
	case TracePull:
		return "Pull"
	}
	return "unknown"
}

// TraceEvent records one state change that succeeded, emitted while the lock
// that linearises it is held (the network's lock; both it and driver.mu for
// TraceDeleteNetwork), so the order of trace events is the order in which
// the driver applied the changes. It exists for the stress harness's
// oracle.
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
	// TracePull: the VNI pulled.
	VNI uint32
}
