// Package reaper runs kernel deletions off the caller's path. Deleting a
// link makes the kernel wait for RCU grace periods (15–50 ms per request
// here) while it uses almost no CPU, so a Leave that hands the veth or the
// sandbox it no longer needs to a Reaper, and returns, costs its caller
// (dockerd, stopping a container) nothing of that wait.
//
// A deletion is a Job. Whoever needs one to be over calls Job.Finish: a
// Join that would reuse a name the deletion still holds, a DeleteNetwork,
// shutdown (Reaper.Close). A job no worker has started yet is then run by
// the caller itself, so waiting for one's own deletion never queues behind
// other networks' deletions; a job a worker runs is waited for. Either way
// Finish returns only once the deletion is done, with its error.
//
// The reaper keeps no copy of what is pending: the owner of the objects
// (the driver's network, under its lock) keeps its Jobs and asks them.
package reaper

import (
	"log/slog"
	"sync"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// DefaultWorkers is the number of deletions run at once. The kernel
// serialises their work on its RTNL lock, but their grace-period waits
// (after RTNL is released) overlap.
const DefaultWorkers = 4

// Reaper runs Jobs on a few worker goroutines.
type Reaper struct {
	log *slog.Logger
	// mu is a leaf lock (taken under a network's lock by Submit and
	// Finish, never calling out while held); it guards queue, pending,
	// held, closed and every Job's state and err.
	mu      *lockorder.Mutex
	queue   []*Job        // jobs not started, in submission order
	pending map[*Job]bool // jobs not done
	held    bool          // workers take no job (Hold)
	closed  bool          // Close was called: Submit runs the job in the caller
	wake    chan struct{} // one token per job that may be waiting for a worker
	stop    chan struct{} // closed by Close: workers exit
	workers sync.WaitGroup
}

type jobState int

const (
	queued  jobState = iota // submitted, not started
	running                 // a worker or a Finish caller runs it
	done                    // finished; err is final
	dropped                 // abandoned before it ran (Abandon)
)

// Job is one deletion.
type Job struct {
	r     *Reaper
	what  string        // for logs: what the job deletes
	run   func() error  // the deletion
	drop  func()        // releases what run would have used, if it never runs (may be nil)
	state jobState      // guarded by r.mu
	err   error         // guarded by r.mu; final once state is done
	fin   chan struct{} // closed when the job is done or dropped
}

// New starts a Reaper with n workers (DefaultWorkers if n < 1) that logs
// failed deletions to log.
func New(n int, log *slog.Logger) *Reaper {
	if n < 1 {
		n = DefaultWorkers
	}
	if log == nil {
		log = slog.Default()
	}
	r := &Reaper{
		log:     log,
		mu:      lockorder.New(lockorder.LevelLeaf),
		pending: map[*Job]bool{},
		wake:    make(chan struct{}, 1024),
		stop:    make(chan struct{}),
	}
	r.workers.Add(n)
	for i := 0; i < n; i++ {
		go r.work()
	}
	return r
}

// Submit queues run, which deletes what; drop (may be nil) releases what
// run would have used if the job is abandoned without running. After Close
// the job runs at once, in the caller.
func (r *Reaper) Submit(what string, run func() error, drop func()) *Job {
	j := &Job{r: r, what: what, run: run, drop: drop, fin: make(chan struct{})}
	r.mu.Lock()
	if r.closed {
		j.state = running
		r.pending[j] = true
		r.mu.Unlock()
		j.execute()
		return j
	}
	r.queue = append(r.queue, j)
	r.pending[j] = true
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default: // tokens enough for every worker are already there
	}
	return j
}

// work is a worker: it runs queued jobs in submission order.
func (r *Reaper) work() {
	defer r.workers.Done()
	for {
		if j := r.take(); j != nil {
			if err := j.execute(); err != nil {
				r.log.Warn("deferred deletion failed; the periodic reconcile retries", "what", j.what, "error", err)
			}
			continue
		}
		select {
		case <-r.wake:
		case <-r.stop:
			return
		}
	}
}

// take returns the oldest queued job, marked running, or nil.
func (r *Reaper) take() *Job {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.held {
		return nil
	}
	for len(r.queue) > 0 {
		j := r.queue[0]
		r.queue[0] = nil
		r.queue = r.queue[1:]
		if j.state == queued { // a Finish caller may have claimed it
			j.state = running
			return j
		}
	}
	return nil
}

// execute runs a job marked running and records its end.
func (j *Job) execute() error {
	err := j.run()
	r := j.r
	r.mu.Lock()
	j.state, j.err = done, err
	delete(r.pending, j)
	r.mu.Unlock()
	close(j.fin)
	return err
}

// Finish returns once the job is done, with its error: it runs the job in
// the caller if no worker has started it, and waits for it otherwise. A
// dropped job (Abandon) returns nil.
func (j *Job) Finish() error {
	r := j.r
	r.mu.Lock()
	if j.state == queued {
		j.state = running
		r.mu.Unlock()
		return j.execute()
	}
	r.mu.Unlock()
	<-j.fin
	r.mu.Lock()
	defer r.mu.Unlock()
	return j.err
}

// Queued reports whether no one has started the job yet: whatever exists
// when it starts is what it deletes.
func (j *Job) Queued() bool {
	j.r.mu.Lock()
	defer j.r.mu.Unlock()
	return j.state == queued
}

// Pending reports whether the job is not done yet.
func (j *Job) Pending() bool {
	j.r.mu.Lock()
	defer j.r.mu.Unlock()
	return j.state == queued || j.state == running
}

// Err returns the job's error once it is done (nil before, and for a job
// that succeeded or was dropped).
func (j *Job) Err() error {
	j.r.mu.Lock()
	defer j.r.mu.Unlock()
	return j.err
}

// Wait returns once every job submitted before the call is done; it runs
// those no worker has started yet in the caller, oldest first.
func (r *Reaper) Wait() {
	r.mu.Lock()
	jobs := make([]*Job, 0, len(r.pending))
	for _, j := range r.queue {
		if j.state == queued {
			jobs = append(jobs, j)
		}
	}
	for j := range r.pending {
		if j.state == running {
			jobs = append(jobs, j)
		}
	}
	r.mu.Unlock()
	for _, j := range jobs {
		j.Finish()
	}
}

// Hold keeps the workers from starting jobs until release is called (jobs
// still run when Finish or Wait asks for them). Tests use it to look at
// the state while deletions are pending.
func (r *Reaper) Hold() (release func()) {
	r.mu.Lock()
	r.held = true
	r.mu.Unlock()
	return func() {
		r.mu.Lock()
		r.held = false
		n := len(r.queue)
		r.mu.Unlock()
		for i := 0; i < n; i++ {
			select {
			case r.wake <- struct{}{}:
			default:
			}
		}
	}
}

// Close runs or waits for every pending job, stops the workers, and makes
// later Submits run in the caller. The deletions a stopping daemon queued
// are done before it exits.
func (r *Reaper) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	r.held = false
	r.mu.Unlock()
	r.stopWorkers()
}

// stopWorkers waits for every pending job, then stops the workers.
func (r *Reaper) stopWorkers() {
	r.Wait()
	close(r.stop)
	r.workers.Wait()
}

// Abandon stops the workers and drops every job not started, as a process
// that dies would (running ones are waited for): the kernel keeps what they
// were to delete. Tests of restarts use it; later Submits run in the
// caller.
func (r *Reaper) Abandon() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	var gone []*Job
	for _, j := range r.queue {
		if j.state == queued {
			j.state = dropped
			delete(r.pending, j)
			gone = append(gone, j)
		}
	}
	r.queue = nil
	r.mu.Unlock()
	for _, j := range gone {
		if j.drop != nil {
			j.drop()
		}
		close(j.fin)
	}
	r.stopWorkers()
}
