//go:build !testhooks

package driver

// traceEnabled: normal builds do not trace; the calls compile to nothing.
const traceEnabled = false

// TestHooks are empty in normal builds (see trace_on.go).
type TestHooks struct{}

func (d *Driver) trace(TraceEvent) {}
