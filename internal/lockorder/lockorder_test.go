package lockorder

import (
	"strings"
	"testing"
)

func TestHierarchy(t *testing.T) {
	if !Enabled {
		t.Skip("built without the lockcheck tag")
	}
	var got []string
	prev := SetViolationHandler(func(msg string) { got = append(got, msg) })
	defer SetViolationHandler(prev)

	n1 := &Mutex{Level: LevelNetwork}
	n2 := &Mutex{Level: LevelNetwork}
	enc := &Mutex{Level: LevelEncryption}
	drv := &Mutex{Level: LevelDriver}

	// Top to bottom is fine.
	n1.Lock()
	enc.Lock()
	drv.Lock()
	drv.Unlock()
	enc.Unlock()
	n1.Unlock()
	if len(got) != 0 {
		t.Fatalf("valid order reported: %v", got)
	}
	// Bottom then top: inversion.
	drv.Lock()
	n1.Lock()
	n1.Unlock()
	drv.Unlock()
	if len(got) != 1 || !strings.Contains(got[0], "taking network.mu while holding driver.mu") {
		t.Fatalf("inversion not reported: %v", got)
	}
	// Two networks at once: inversion.
	n1.Lock()
	n2.Lock()
	n2.Unlock()
	n1.Unlock()
	if len(got) != 2 || !strings.Contains(got[1], "taking network.mu while holding network.mu") {
		t.Fatalf("two locks of one level not reported: %v", got)
	}
	// Locks held by another goroutine do not count.
	drv.Lock()
	done := make(chan struct{})
	go func() { n2.Lock(); n2.Unlock(); close(done) }()
	<-done
	drv.Unlock()
	if len(got) != 2 {
		t.Fatalf("another goroutine's lock counted: %v", got)
	}
}
