//go:build !faultinject

package driver

// FaultsAvailable reports whether this build can activate faults.
const FaultsAvailable = false

func faultActive(Fault) bool { return false }
