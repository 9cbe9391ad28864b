// Package latency records durations into fixed buckets with atomic
// counters: the owner of an operation (the state file's writes, the
// encryption owner's rotations) records without a lock and without
// knowing about Prometheus, and the metrics collector reads a snapshot at
// scrape time. Nobody keeps a copy of the figures.
package latency

import (
	"sync/atomic"
	"time"
)

// bounds are the upper bounds of the buckets, in seconds: from half a
// millisecond (a bbolt write on a fast disk) to five minutes (a key
// rotation waiting for every host). Prometheus's le labels.
var bounds = [...]float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}

// Recorder counts durations. The zero value is ready; it is safe for
// concurrent use.
type Recorder struct {
	buckets [len(bounds)]atomic.Uint64 // non-cumulative: buckets[i] counts bounds[i-1] < d <= bounds[i]
	over    atomic.Uint64              // above the last bound
	sumNs   atomic.Uint64
}

// Observe records one duration.
func (r *Recorder) Observe(d time.Duration) {
	if d < 0 {
		d = 0
	}
	r.sumNs.Add(uint64(d))
	s := d.Seconds()
	for i, b := range bounds {
		if s <= b {
			r.buckets[i].Add(1)
			return
		}
	}
	r.over.Add(1)
}

// Snapshot is a point-in-time reading of a Recorder.
type Snapshot struct {
	Count      uint64
	SumSeconds float64
	// Cumulative maps each bucket's upper bound (seconds) to the number of durations at
	// most that long (Prometheus's histogram buckets).
	Cumulative map[float64]uint64
}

// Snapshot reads the counters. Concurrent Observes may be partly included;
// the buckets are read before the total so the count is never below them.
func (r *Recorder) Snapshot() Snapshot {
	s := Snapshot{Cumulative: make(map[float64]uint64, len(bounds))}
	var cum uint64
	for i, b := range bounds {
		cum += r.buckets[i].Load()
		s.Cumulative[b] = cum
	}
	s.Count = cum + r.over.Load()
	s.SumSeconds = time.Duration(r.sumNs.Load()).Seconds()
	return s
}
