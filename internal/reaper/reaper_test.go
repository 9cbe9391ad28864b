package reaper

import (
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/testutil/logbuf"
)

func newTestReaper(t *testing.T, n int) (*Reaper, *logbuf.Buffer) {
	t.Helper()
	var buf logbuf.Buffer
	r := New(n, slog.New(slog.NewTextHandler(&buf, nil)))
	t.Cleanup(r.Close)
	return r, &buf
}

// waitFor polls cond until it holds or a generous deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// A worker runs a submitted job without anyone asking; a failure is logged
// with what the job deletes, and Finish returns it.
func TestWorkerRunsJobAndLogsFailure(t *testing.T) {
	r, log := newTestReaper(t, 1)
	boom := errors.New("boom")
	j := r.Submit("veth x", func() error { return boom }, nil)
	waitFor(t, "the job to be done", func() bool { return !j.Pending() })
	if err := j.Finish(); !errors.Is(err, boom) {
		t.Fatalf("Finish = %v, want %v", err, boom)
	}
	if !errors.Is(j.Err(), boom) {
		t.Fatalf("Err = %v, want %v", j.Err(), boom)
	}
	waitFor(t, "the failure to be logged", func() bool { return log.Count("deferred deletion failed", "what=\"veth x\"", "error=boom") == 1 })
}

// A job no worker has started is run by Finish in the caller: while the
// workers are held, Finish still returns with the job done.
func TestFinishRunsQueuedJobInCaller(t *testing.T) {
	r, _ := newTestReaper(t, 2)
	release := r.Hold()
	defer release()
	ran := 0
	j := r.Submit("sandbox n", func() error { ran++; return nil }, nil)
	if !j.Queued() || !j.Pending() {
		t.Fatalf("held job: queued %v pending %v, want both", j.Queued(), j.Pending())
	}
	if err := j.Finish(); err != nil {
		t.Fatal(err)
	}
	if ran != 1 || j.Queued() || j.Pending() {
		t.Fatalf("after Finish: ran %d times, queued %v, pending %v; want once, neither", ran, j.Queued(), j.Pending())
	}
	release()
	// The workers, released, must not run it again.
	j2 := r.Submit("marker", func() error { return nil }, nil)
	j2.Finish()
	r.Wait()
	if ran != 1 {
		t.Fatalf("job ran %d times, want once", ran)
	}
}

// Finish of a job a worker runs waits for it to end.
func TestFinishWaitsForRunningJob(t *testing.T) {
	r, _ := newTestReaper(t, 1)
	started, unblock := make(chan struct{}), make(chan struct{})
	var end atomic.Bool
	j := r.Submit("slow", func() error {
		close(started)
		<-unblock
		end.Store(true)
		return nil
	}, nil)
	<-started
	if j.Queued() || !j.Pending() {
		t.Fatalf("running job: queued %v pending %v, want pending only", j.Queued(), j.Pending())
	}
	go func() { time.Sleep(20 * time.Millisecond); close(unblock) }()
	j.Finish()
	if !end.Load() {
		t.Fatal("Finish returned before the running job ended")
	}
}

// Every job runs exactly once however workers, Finish and Wait race.
func TestEveryJobRunsOnce(t *testing.T) {
	r, _ := newTestReaper(t, 4)
	const n = 500
	var runs [n]atomic.Int32
	jobs := make([]*Job, n)
	for i := range jobs {
		jobs[i] = r.Submit("j", func() error { runs[i].Add(1); return nil }, nil)
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; i < n; i += 4 {
				jobs[i].Finish()
			}
		}()
	}
	r.Wait()
	wg.Wait()
	for i := range runs {
		if c := runs[i].Load(); c != 1 {
			t.Fatalf("job %d ran %d times", i, c)
		}
	}
}

// Wait runs (or waits for) everything submitted before it; Close does too,
// then Submit runs jobs in the caller.
func TestWaitAndCloseDrain(t *testing.T) {
	var buf logbuf.Buffer
	r := New(2, slog.New(slog.NewTextHandler(&buf, nil)))
	release := r.Hold()
	var n atomic.Int32
	for i := 0; i < 10; i++ {
		r.Submit("j", func() error { n.Add(1); return nil }, nil)
	}
	r.Wait()
	if n.Load() != 10 {
		t.Fatalf("after Wait %d of 10 jobs ran", n.Load())
	}
	for i := 0; i < 5; i++ {
		r.Submit("j", func() error { n.Add(1); return nil }, nil)
	}
	r.Close()
	release()
	if n.Load() != 15 {
		t.Fatalf("after Close %d of 15 jobs ran", n.Load())
	}
	j := r.Submit("late", func() error { n.Add(1); return nil }, nil)
	if j.Pending() || n.Load() != 16 {
		t.Fatalf("a Submit after Close did not run at once (pending %v, ran %d)", j.Pending(), n.Load())
	}
}

// Abandon drops the jobs not started (their drop releases what they hold)
// and runs none of them.
func TestAbandonDropsQueuedJobs(t *testing.T) {
	r := New(1, nil)
	r.Hold()
	var ran, released atomic.Int32
	jobs := make([]*Job, 3)
	for i := range jobs {
		jobs[i] = r.Submit("j", func() error { ran.Add(1); return nil }, func() { released.Add(1) })
	}
	r.Abandon()
	if ran.Load() != 0 || released.Load() != 3 {
		t.Fatalf("Abandon: %d jobs ran, %d released; want 0 and 3", ran.Load(), released.Load())
	}
	for _, j := range jobs {
		if j.Pending() || j.Finish() != nil {
			t.Fatal("a dropped job is still pending or failed")
		}
	}
}
