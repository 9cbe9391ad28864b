//go:build !lockcheck

package lockorder

import "sync"

// Enabled reports whether acquisitions are checked (the lockcheck build tag).
const Enabled = false

// Mutex is a sync.Mutex with a level in the lock hierarchy; make it with
// New.
type Mutex struct {
	sync.Mutex
	level Level
}

// SetViolationHandler is a no-op without the lockcheck tag.
func SetViolationHandler(f func(msg string)) func(msg string) { return f }
