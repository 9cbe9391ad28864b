//go:build !lockcheck

package lockorder

import "sync"

// Enabled reports whether acquisitions are checked (the lockcheck build tag).
const Enabled = false

// Mutex is a sync.Mutex with a level in the lock hierarchy. Set Level before
// first use; the zero Level is not checked.
type Mutex struct {
	sync.Mutex
	Level int
}

// SetViolationHandler is a no-op without the lockcheck tag.
func SetViolationHandler(f func(msg string)) func(msg string) { return f }
