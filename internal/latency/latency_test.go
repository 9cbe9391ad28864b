package latency

import (
	"testing"
	"time"
)

func TestSnapshotIsCumulative(t *testing.T) {
	var r Recorder
	r.Observe(300 * time.Microsecond) // first bucket
	r.Observe(3 * time.Millisecond)   // le 0.005
	r.Observe(10 * time.Minute)       // above every bound
	s := r.Snapshot()
	if s.Count != 3 {
		t.Fatalf("count %d, want 3", s.Count)
	}
	if got := s.Cumulative[0.0005]; got != 1 {
		t.Errorf("le 0.0005: %d, want 1", got)
	}
	if got := s.Cumulative[0.0025]; got != 1 {
		t.Errorf("le 0.0025: %d, want 1", got)
	}
	if got := s.Cumulative[0.005]; got != 2 {
		t.Errorf("le 0.005: %d, want 2", got)
	}
	if got := s.Cumulative[300]; got != 2 {
		t.Errorf("le 300: %d, want 2 (10 min is above every bound)", got)
	}
	want := (300*time.Microsecond + 3*time.Millisecond + 10*time.Minute).Seconds()
	if s.SumSeconds != want {
		t.Errorf("sum %v, want %v", s.SumSeconds, want)
	}
}
