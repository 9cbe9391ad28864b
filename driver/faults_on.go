//go:build faultinject

package driver

import "sync/atomic"

// FaultsAvailable reports whether this build can activate faults.
const FaultsAvailable = true

var activeFault atomic.Int64

// SetFault activates f (FaultNone deactivates) for every driver in the
// process and returns the previous fault.
func SetFault(f Fault) Fault { return Fault(activeFault.Swap(int64(f))) }

func faultActive(f Fault) bool { return Fault(activeFault.Load()) == f }
