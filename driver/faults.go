package driver

// Fault names a deliberate bug that test builds (tag faultinject) can switch
// on, so that the stress harness can prove it catches real bugs. Without the
// tag no fault can be activated and every check compiles to false.
type Fault int

// Faults.
const (
	FaultNone Fault = iota
	// FaultDropPeerDeletes skips the kernel deletes of remote peer events:
	// the peer DB forgets the peer, the kernel keeps it.
	FaultDropPeerDeletes
	// FaultLeaveKeepsLocal leaves the local peer in the peer DB on Leave, so
	// a remote claimant of the IP is never programmed again.
	FaultLeaveKeepsLocal
)
