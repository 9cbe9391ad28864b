//go:build lockcheck

package lockorder

import (
	"bytes"
	"fmt"
	"runtime"
	"strconv"
	"sync"
)

// Enabled reports whether acquisitions are checked (the lockcheck build tag).
const Enabled = true

// Mutex is a sync.Mutex with a level in the lock hierarchy; make it with
// New.
type Mutex struct {
	mu    sync.Mutex
	level Level
}

type held struct {
	m     *Mutex
	level Level
	stack string
}

var (
	regMu sync.Mutex
	// held locks per goroutine id; guarded by regMu (a leaf lock).
	holding = map[uint64][]held{}
	// Violations are reported here; the default panics. Tests may replace
	// it to count inversions instead.
	onViolation = func(msg string) { panic(msg) }
)

// SetViolationHandler replaces the handler called on an inversion (the
// default panics) and returns the previous one.
func SetViolationHandler(f func(msg string)) func(msg string) {
	regMu.Lock()
	defer regMu.Unlock()
	prev := onViolation
	onViolation = f
	return prev
}

func goid() uint64 {
	var buf [64]byte
	n := runtime.Stack(buf[:], false)
	b := bytes.TrimPrefix(buf[:n], []byte("goroutine "))
	if i := bytes.IndexByte(b, ' '); i > 0 {
		b = b[:i]
	}
	id, _ := strconv.ParseUint(string(b), 10, 64)
	return id
}

func stack() string {
	buf := make([]byte, 4096)
	return string(buf[:runtime.Stack(buf, false)])
}

func (m *Mutex) check() {
	g := goid()
	regMu.Lock()
	var msg string
	if m.level == 0 {
		msg = "lock without a level: every lockorder.Mutex must be made by lockorder.New\nnow:\n" + stack()
	}
	for _, h := range holding[g] {
		if msg == "" && h.level >= m.level {
			msg = fmt.Sprintf("lock order inversion: taking %s while holding %s (the hierarchy is %s, one lock per level)\nheld since:\n%s\nnow:\n%s",
				m.level, h.level, hierarchy(), h.stack, stack())
			break
		}
	}
	handler := onViolation
	regMu.Unlock()
	if msg != "" {
		handler(msg)
	}
}

func (m *Mutex) record() {
	g := goid()
	st := stack()
	regMu.Lock()
	holding[g] = append(holding[g], held{m: m, level: m.level, stack: st})
	regMu.Unlock()
}

func (m *Mutex) forget() {
	regMu.Lock()
	defer regMu.Unlock()
	// Unlock may happen on another goroutine than Lock (allowed by
	// sync.Mutex): search every goroutine's list.
	for g, hs := range holding {
		for i := len(hs) - 1; i >= 0; i-- {
			if hs[i].m == m {
				hs = append(hs[:i], hs[i+1:]...)
				if len(hs) == 0 {
					delete(holding, g)
				} else {
					holding[g] = hs
				}
				return
			}
		}
	}
}

// Lock checks the hierarchy, then locks.
func (m *Mutex) Lock() {
	m.check()
	m.mu.Lock()
	m.record()
}

// TryLock is sync.Mutex.TryLock with the hierarchy check.
func (m *Mutex) TryLock() bool {
	m.check()
	if !m.mu.TryLock() {
		return false
	}
	m.record()
	return true
}

// Unlock unlocks.
func (m *Mutex) Unlock() {
	m.forget()
	m.mu.Unlock()
}

// hierarchy renders the hierarchy for reports.
func hierarchy() string {
	s := ""
	for i, l := range Levels() {
		if i > 0 {
			s += " → "
		}
		s += l.String()
	}
	return s
}
