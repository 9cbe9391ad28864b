package lockorder

//lint:file-ignore SA2001 these tests take locks only to have the acquisition checked: the empty critical sections are the point.

import (
	"fmt"
	"strings"
	"testing"
)

// collect replaces the violation handler for the test and returns the
// reports made so far.
func collect(t *testing.T) func() []string {
	t.Helper()
	if !Enabled {
		t.Skip("built without the lockcheck tag")
	}
	var got []string
	prev := SetViolationHandler(func(msg string) { got = append(got, msg) })
	t.Cleanup(func() { SetViolationHandler(prev) })
	return func() []string { r := got; got = nil; return r }
}

// TestEveryPair takes every ordered pair of levels (a held, then b taken)
// and checks that exactly the pairs that go up or sideways in the hierarchy
// (b's level not below a's) are reported, naming both locks.
func TestEveryPair(t *testing.T) {
	reports := collect(t)
	for _, a := range Levels() {
		for _, b := range Levels() {
			t.Run(fmt.Sprintf("%s/then/%s", a, b), func(t *testing.T) {
				held, taken := New(a), New(b)
				held.Lock()
				taken.Lock()
				taken.Unlock()
				held.Unlock()
				got := reports()
				if b > a {
					if len(got) != 0 {
						t.Fatalf("taking %s under %s is the hierarchy's order, but was reported: %v", b, a, got)
					}
					return
				}
				want := fmt.Sprintf("taking %s while holding %s", b, a)
				if len(got) != 1 || !strings.Contains(got[0], want) {
					t.Fatalf("inversion %q not reported: %v", want, got)
				}
			})
		}
	}
}

// TestChain: a chain down the hierarchy is fine; an inversion is found
// against any lock held, not only the last one taken.
func TestChain(t *testing.T) {
	reports := collect(t)
	ls := Levels()
	var ms []*Mutex
	for _, l := range ls {
		m := New(l)
		m.Lock()
		ms = append(ms, m)
	}
	if got := reports(); len(got) != 0 {
		t.Fatalf("the whole hierarchy top to bottom was reported: %v", got)
	}
	n := New(LevelNetwork)
	n.Lock()
	n.Unlock()
	if got := reports(); len(got) != 1 || !strings.Contains(got[0], "taking network.mu while holding network.mu") {
		t.Fatalf("inversion against the first lock held not reported: %v", got)
	}
	for i := len(ms) - 1; i >= 0; i-- {
		ms[i].Unlock()
	}
}

// TestZeroMutexReported: a Mutex not made by New has no level and is
// reported at its first Lock, so no lock escapes the check.
func TestZeroMutexReported(t *testing.T) {
	reports := collect(t)
	var m Mutex
	m.Lock()
	m.Unlock()
	if got := reports(); len(got) != 1 || !strings.Contains(got[0], "without a level") {
		t.Fatalf("zero Mutex not reported: %v", got)
	}
}

// TestNewRefusesUnknownLevel: a level outside the hierarchy is a
// programming error caught where the lock is made.
func TestNewRefusesUnknownLevel(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("New(0) did not panic")
		}
	}()
	New(0)
}

// TestOtherGoroutine: locks held by another goroutine do not count.
func TestOtherGoroutine(t *testing.T) {
	reports := collect(t)
	drv := New(LevelDriver)
	n := New(LevelNetwork)
	drv.Lock()
	done := make(chan struct{})
	go func() { n.Lock(); n.Unlock(); close(done) }()
	<-done
	drv.Unlock()
	if got := reports(); len(got) != 0 {
		t.Fatalf("another goroutine's lock counted: %v", got)
	}
}
