//go:build testhooks

package driver

// traceEnabled: this build traces (tag testhooks, for the stress harness).
const traceEnabled = true

// TestHooks are the driver's hooks for tests.
type TestHooks struct {
	// Trace, if set, is told of every state change that succeeded, under
	// the lock that linearises it (see TraceEvent). It must be fast and
	// must not call into the Driver.
	Trace func(TraceEvent)
}

// trace emits ev to the configured tracer, under the lock that linearises
// the change (see TraceEvent).
func (d *Driver) trace(ev TraceEvent) {
	if d.cfg.Trace != nil {
		d.cfg.Trace(ev)
	}
}
