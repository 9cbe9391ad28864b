package cluster

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// The interest benchmark: members spread over several OS processes (this
// test binary re-executed as workers, each hosting some members on their
// own loopback addresses 127.0.15.x), so that no one process's scheduler
// or GC decides the figures. The coordinator (TestBenchInterest) starts
// the workers, has every member define a network on all hosts (VNI
// benchVNIAll) and five members one more (benchVNIFive), and publishes
// records one at a time from a random holder, each waited for until every
// other holder's watcher has it. It reports, per network: deltas applied
// per change (over all members), messages and bytes the cluster sent per
// change (deltas, digests, snapshots, requests and definitions, minus the
// idle rate measured just before), p50/p99 of the delivery delay from
// publish to a receiver's watcher (over every receiver of every change),
// and the CPU the worker processes used, per member, idle and while
// changing. The join of many members at once on a busy machine declares
// false deaths (counted and shown); the windows measured come after it.
// Heavy: OVERLAYD_BENCH_INTEREST=1, sizes in
// OVERLAYD_BENCH_SIZES (default 10,50), modes in OVERLAYD_BENCH_MODES
// (default on,off: Interest on and off, off being every record to every
// member as before), memberlist timings in OVERLAYD_BENCH_PROFILE (a
// --gossip-profile value; default lan).

const (
	benchVNIAll  = 1500
	benchVNIFive = 1501
	benchPort    = 27947
	// benchJoinStep members join at a time.
	benchJoinStep = 10
)

// benchCmd is a coordinator's command to a worker (one JSON line).
type benchCmd struct {
	Op     string   `json:"op"` // start, define, publish, members, sets, stats, quit
	Member int      `json:"member,omitempty"`
	First  int      `json:"first,omitempty"` // start: members First..First+Count-1
	Count  int      `json:"count,omitempty"`
	Seed   string   `json:"seed,omitempty"`
	On     bool     `json:"on,omitempty"` // start: Interest
	VNIs   []uint32 `json:"vnis,omitempty"`
	VNI    uint32   `json:"vni,omitempty"`
	ID     string   `json:"id,omitempty"`
	IP     string   `json:"ip,omitempty"`
}

// benchMsg is a worker's line: a reply (Reply set) or a delivery event.
type benchMsg struct {
	Reply  bool   `json:"reply,omitempty"`
	Err    string `json:"err,omitempty"`
	At     int64  `json:"at,omitempty"`  // publish: the wall clock in ns just before it; event: when the watcher got it
	Min    int    `json:"min,omitempty"` // members, sets: the lowest count over its members
	Stats  *benchStats
	Member int    `json:"member,omitempty"` // event: the receiving member
	ID     string `json:"id,omitempty"`     // event: the endpoint id delivered
}

type benchStats struct {
	Msgs, Bytes, Deltas, Records, Failures, WireBytes uint64
	CPU                                               int64 // ns of user+system time of the process
	Wall                                              int64 // the wall clock in ns when CPU was read
}

// cpuRate returns the CPU the workers used between two per-worker
// samples, in ms per s of each worker's own window (the samples of
// different workers are not taken at the same instant).
func cpuRate(a, b []benchStats) float64 {
	var r float64
	for i := range a {
		if w := b[i].Wall - a[i].Wall; w > 0 {
			r += float64(b[i].CPU-a[i].CPU) / float64(w) * 1e3
		}
	}
	return r
}

func sumStats(ws []benchStats) benchStats {
	var s benchStats
	for i := range ws {
		s.add(&ws[i])
	}
	return s
}

func (s *benchStats) add(o *benchStats) {
	s.Msgs += o.Msgs
	s.Bytes += o.Bytes
	s.Deltas += o.Deltas
	s.Records += o.Records
	s.Failures += o.Failures
	s.WireBytes += o.WireBytes
	s.CPU += o.CPU
}

// loadavg is the machine's 1-minute load average (it shares 2 cores).
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}

func benchHost(i int) string { return fmt.Sprintf("127.0.15.%d", i+1) }

// TestBenchInterestWorker is a worker process (started by
// TestBenchInterest): commands on fd 3, replies and events on fd 4.
func TestBenchInterestWorker(t *testing.T) {
	if os.Getenv("OVERLAYD_BENCH_WORKER") == "" {
		t.Skip("a worker of TestBenchInterest")
	}
	in := bufio.NewScanner(os.NewFile(3, "commands"))
	out := os.NewFile(4, "events")
	var outMu sync.Mutex
	emit := func(m benchMsg) {
		b, _ := json.Marshal(m)
		outMu.Lock()
		defer outMu.Unlock()
		_, _ = out.Write(append(b, '\n'))
	}
	var wire atomic.Int64
	nodes := map[int]*node{}
	for in.Scan() {
		var cmd benchCmd
		if err := json.Unmarshal(in.Bytes(), &cmd); err != nil {
			t.Fatalf("bad command %q: %v", in.Text(), err)
		}
		reply := benchMsg{Reply: true}
		switch cmd.Op {
		case "start":
			for i := cmd.First; i < cmd.First+cmd.Count; i++ {
				o := nodeOpts{bytes: &wire, tweak: func(c *Config) {
					d := DefaultConfig()
					c.DigestInterval, c.ReconnectInterval = d.DigestInterval, d.ReconnectInterval
					c.Interest = cmd.On
					if p := os.Getenv("OVERLAYD_BENCH_PROFILE"); p != "" {
						prof, err := ParseProfile(p)
						if err != nil {
							t.Fatalf("OVERLAYD_BENCH_PROFILE: %v", err)
						}
						c.Profile = prof
					}
				}}
				if i > 0 {
					o.seeds = []string{cmd.Seed}
				}
				nd := startNode(t, fmt.Sprintf("m%03d", i), benchHost(i), benchPort, o)
				member := i
				nd.w.mu.Lock()
				nd.w.onChange = func(k peerdb.Key, _, next *peerdb.Peer, at time.Time) {
					if next != nil && strings.HasPrefix(k.EndpointID, "bench-") {
						emit(benchMsg{Member: member, ID: k.EndpointID, At: at.UnixNano()})
					}
				}
				nd.w.mu.Unlock()
				nodes[i] = nd
			}
		case "define":
			defs := map[uint32]netdef.Definition{}
			for _, v := range cmd.VNIs {
				defs[v] = sampleDef(1450, false, v)
			}
			nodes[cmd.Member].c.SyncDefinitions(nodes[cmd.Member].c.LocalMark(), defs)
		case "publish":
			n := nodes[cmd.Member]
			p := n.peer(cmd.ID, cmd.IP)
			reply.At = time.Now().UnixNano()
			n.c.PublishLocalPeer(cmd.VNI, nil, &p)
		case "members", "sets":
			reply.Min = -1
			if len(nodes) == 0 {
				reply.Min = 1 << 30 // nothing started here yet
			}
			for _, n := range nodes {
				v := n.c.ml.NumMembers()
				if cmd.Op == "sets" {
					v = 0
					n.c.mu.Lock()
					for _, o := range n.c.replica.origins {
						if o.defsVer != 0 {
							v++
						}
					}
					n.c.mu.Unlock()
				}
				if reply.Min < 0 || v < reply.Min {
					reply.Min = v
				}
			}
		case "stats":
			st := &benchStats{WireBytes: uint64(wire.Load())}
			for _, n := range nodes {
				s := n.c.Status().Stats
				st.Msgs += s.MessagesSent
				st.Bytes += s.BytesSent
				st.Deltas += s.Deltas
				st.Records += s.RecordsReceived
				st.Failures += s.MemberFailures
			}
			var ru syscall.Rusage
			if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
				st.CPU, st.Wall = ru.Utime.Nano()+ru.Stime.Nano(), time.Now().UnixNano()
			}
			reply.Stats = st
		case "quit":
			for _, n := range nodes {
				n.stop()
			}
			emit(reply)
			return
		default:
			reply.Err = "unknown op " + cmd.Op
		}
		emit(reply)
	}
}

// benchWorker is the coordinator's end of one worker.
type benchWorker struct {
	cmd     *exec.Cmd
	in      io.WriteCloser
	replies chan benchMsg
	first   int
	count   int
}

func (w *benchWorker) call(t *testing.T, c benchCmd) benchMsg {
	t.Helper()
	b, _ := json.Marshal(c)
	if _, err := w.in.Write(append(b, '\n')); err != nil {
		t.Fatalf("worker of members %d..: %v", w.first, err)
	}
	select {
	case r, ok := <-w.replies:
		if !ok {
			t.Fatalf("worker of members %d.. exited", w.first)
		}
		if r.Err != "" {
			t.Fatalf("worker of members %d..: %s", w.first, r.Err)
		}
		return r
	case <-time.After(2 * time.Minute):
		t.Fatalf("worker of members %d.. did not answer %s", w.first, c.Op)
	}
	return benchMsg{}
}

// TestBenchInterest is the coordinator (see the top of this file).
func TestBenchInterest(t *testing.T) {
	if os.Getenv("OVERLAYD_BENCH_INTEREST") == "" {
		t.Skip("set OVERLAYD_BENCH_INTEREST=1 to run the interest benchmark (members over several processes)")
	}
	sizes := []int{10, 50}
	if s := os.Getenv("OVERLAYD_BENCH_SIZES"); s != "" {
		sizes = nil
		for _, f := range splitComma(s) {
			n, err := strconv.Atoi(f)
			if err != nil || n < 6 || n > 250 {
				t.Fatalf("OVERLAYD_BENCH_SIZES: %q is not a size in 6..250", f)
			}
			sizes = append(sizes, n)
		}
	}
	modes := []string{"on", "off"}
	if s := os.Getenv("OVERLAYD_BENCH_MODES"); s != "" {
		modes = splitComma(s)
	}
	for _, n := range sizes {
		for _, mode := range modes {
			t.Run(fmt.Sprintf("members=%d/interest=%s", n, mode), func(t *testing.T) { benchInterest(t, n, mode == "on") })
		}
	}
}

func benchInterest(t *testing.T, n int, on bool) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	procs := min(8, max(2, n/25))
	if s := os.Getenv("OVERLAYD_BENCH_PROCS"); s != "" {
		procs, _ = strconv.Atoi(s)
	}
	events := make(chan benchMsg, 1<<17) // never full: a blocked reader would block the replies
	var workers []*benchWorker
	for p := range procs {
		w := &benchWorker{first: p * n / procs, replies: make(chan benchMsg, 1)}
		w.count = (p+1)*n/procs - w.first
		cmdR, cmdW, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		evR, evW, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		w.cmd = exec.Command(exe, "-test.run=^TestBenchInterestWorker$", "-test.count=1")
		w.cmd.Env = append(os.Environ(), "OVERLAYD_BENCH_WORKER=1", "GOMAXPROCS=2")
		w.cmd.Stdout, w.cmd.Stderr = io.Discard, os.Stderr // its PASS lines: noise
		w.cmd.ExtraFiles = []*os.File{cmdR, evW}
		if err := w.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmdR.Close()
		evW.Close()
		w.in = cmdW
		go func() {
			sc := bufio.NewScanner(evR)
			for sc.Scan() {
				var m benchMsg
				if json.Unmarshal(sc.Bytes(), &m) != nil {
					continue
				}
				if m.Reply {
					w.replies <- m
				} else {
					events <- m
				}
			}
			close(w.replies)
		}()
		workers = append(workers, w)
		t.Cleanup(func() {
			_ = w.in.Close() // the worker ends at the end of its commands
			done := make(chan struct{})
			go func() { _ = w.cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				_ = w.cmd.Process.Kill() // our own child, by its PID
				<-done
			}
		})
	}
	workerOf := func(member int) *benchWorker {
		for _, w := range workers {
			if member >= w.first && member < w.first+w.count {
				return w
			}
		}
		panic("no worker")
	}
	seed := fmt.Sprintf("%s:%d", benchHost(0), benchPort)
	start := time.Now()
	waitAll := func(op string, want int, timeout time.Duration) {
		deadline := time.Now().Add(timeout)
		for {
			low := want
			for _, w := range workers {
				low = min(low, w.call(t, benchCmd{Op: op}).Min)
			}
			if low >= want {
				return
			}
			if time.Now().After(deadline) {
				// What the members cost while they fail to agree.
				var w0, w1 []benchStats
				for _, w := range workers {
					w0 = append(w0, *w.call(t, benchCmd{Op: "stats"}).Stats)
				}
				time.Sleep(5 * time.Second) // the window measured
				for _, w := range workers {
					w1 = append(w1, *w.call(t, benchCmd{Op: "stats"}).Stats)
				}
				cpu := cpuRate(w0, w1)
				t.Fatalf("n=%d: %s: lowest %d of %d after %v; CPU %.0f ms/s for the %d members started (%.2f per member), %d member failures in ~5 s; load %s",
					n, op, low, want, timeout, cpu, want, cpu/float64(want), sumStats(w1).Failures-sumStats(w0).Failures, loadavg())
			}
			time.Sleep(200 * time.Millisecond) // polling other processes
		}
	}
	// Members join in steps of benchJoinStep, each once the previous
	// ones see each other: a whole cluster joining one seed at once on a
	// busy machine mostly measures false deaths.
	for started := 0; started < n; {
		next := min(n, started+benchJoinStep)
		for _, w := range workers {
			lo, hi := max(started, w.first), min(next, w.first+w.count)
			if lo < hi {
				w.call(t, benchCmd{Op: "start", First: lo, Count: hi - lo, Seed: seed, On: on})
			}
		}
		started = next
		waitAll("members", started, 3*time.Minute)
	}
	t.Logf("n=%d interest=%v: %d processes, gossip profile %q; all members see each other after %v; load %s",
		n, on, procs, os.Getenv("OVERLAYD_BENCH_PROFILE"), time.Since(start).Round(time.Millisecond), loadavg())
	five := map[int]bool{}
	for i := range 5 {
		five[i*n/5+n/10] = true // spread over the workers
	}
	for i := range n {
		vnis := []uint32{benchVNIAll}
		if five[i] {
			vnis = append(vnis, benchVNIFive)
		}
		workerOf(i).call(t, benchCmd{Op: "define", Member: i, VNIs: vnis})
	}
	waitAll("sets", n-1, time.Minute)
	perWorker := func() []benchStats {
		var ws []benchStats
		for _, w := range workers {
			ws = append(ws, *w.call(t, benchCmd{Op: "stats"}).Stats)
		}
		return ws
	}
	stats := func() benchStats { return sumStats(perWorker()) }
	// Idle: let the joins' traffic settle, then measure the idle rate.
	settle := time.Now()
	for s0 := stats(); ; {
		time.Sleep(2 * time.Second) // sampling the rate
		s1 := stats()
		if s1.Msgs-s0.Msgs < uint64(n) || time.Since(settle) > 30*time.Second {
			break
		}
		s0 = s1
	}
	idleW0 := perWorker()
	idle0, idleT := sumStats(idleW0), time.Now()
	// The idle window being measured: longer than the idle digest round
	// (DigestMaxInterval, jittered by up to a fifth).
	time.Sleep(DefaultDigestMaxInterval * 13 / 10)
	idleW1 := perWorker()
	idle1 := sumStats(idleW1)
	idleDur := time.Since(idleT).Seconds()
	idleMsgs := float64(idle1.Msgs-idle0.Msgs) / idleDur
	idleBytes := float64(idle1.Bytes-idle0.Bytes) / idleDur
	idleCPU := cpuRate(idleW0, idleW1)
	t.Logf("n=%d interest=%v: idle: %.0f msgs/s %.0f B/s of records and digests, CPU %.0f ms/s (%.2f ms/s per member), member failures so far %d (%d in the idle window); load %s",
		n, on, idleMsgs, idleBytes, idleCPU, idleCPU/float64(n), idle1.Failures, idle1.Failures-idle0.Failures, loadavg())

	rng := rand.New(rand.NewPCG(uint64(n), 15))
	changes := 40
	seq := 0
	for _, sc := range []struct {
		name    string
		vni     uint32
		holders []int
	}{
		{"network on 5 hosts", benchVNIFive, slices.Sorted(func(yield func(int) bool) {
			for i := range five {
				if !yield(i) {
					return
				}
			}
		})},
		{"network on all hosts", benchVNIAll, func() []int {
			var h []int
			for i := range n {
				h = append(h, i)
			}
			return h
		}()},
	} {
		var lat []time.Duration
		missed := 0
		w0, t0 := perWorker(), time.Now()
		s0 := sumStats(w0)
		for range changes {
			origin := sc.holders[rng.IntN(len(sc.holders))]
			seq++
			id := fmt.Sprintf("bench-%d", seq)
			want := len(sc.holders) - 1
			r := workerOf(origin).call(t, benchCmd{Op: "publish", Member: origin, VNI: sc.vni, ID: id,
				IP: fmt.Sprintf("198.51.100.%d", 1+seq%250)})
			isHolder := map[int]bool{}
			for _, h := range sc.holders {
				isHolder[h] = true
			}
			got := 0
			deadline := time.After(30 * time.Second)
		wait:
			for got < want {
				select {
				case ev := <-events:
					if ev.ID != id || !isHolder[ev.Member] {
						continue // an earlier change, or a member without the network (interest off)
					}
					got++
					lat = append(lat, time.Duration(ev.At-r.At))
				case <-deadline:
					// A starved machine declares members dead: say so in
					// the figures rather than stop.
					missed += want - got
					break wait
				}
			}
		}
		dur := time.Since(t0).Seconds()
		// The digests that follow the changes (DigestInterval after, then
		// doubling): wait for the first two rounds, so they are counted
		// here and not in the next scenario (the small network goes
		// first: the rounds of the big one would swamp it).
		time.Sleep(4 * DefaultDigestInterval) // the digest rounds that follow a change
		w1 := perWorker()
		s1 := sumStats(w1)
		dur2 := time.Since(t0).Seconds()
		msgs := (float64(s1.Msgs-s0.Msgs) - idleMsgs*dur2) / float64(changes)
		bytes := (float64(s1.Bytes-s0.Bytes) - idleBytes*dur2) / float64(changes)
		cpu := cpuRate(w0, w1)
		if len(lat) == 0 {
			lat = append(lat, -1)
		}
		t.Logf("n=%d interest=%v %s (%d holders): per change: %.1f deltas applied, %.1f records received, %.0f msgs and %.0f B sent (%.0f and %.0f minus idle); delivery p50 %v p99 %v max %v (%d deliveries, %d missed after 30 s, %.1f changes/s); CPU %.0f ms/s (%.2f per member); member failures during the run %d; load %s",
			n, on, sc.name, len(sc.holders), float64(s1.Deltas-s0.Deltas)/float64(changes), float64(s1.Records-s0.Records)/float64(changes),
			float64(s1.Msgs-s0.Msgs)/float64(changes), float64(s1.Bytes-s0.Bytes)/float64(changes), msgs, bytes,
			pct(lat, 50).Round(10*time.Microsecond), pct(lat, 99).Round(10*time.Microsecond), pct(lat, 100).Round(10*time.Microsecond),
			len(lat), missed, float64(changes)/dur, cpu, cpu/float64(n), s1.Failures-s0.Failures, loadavg())
	}
	for _, w := range workers {
		w.call(t, benchCmd{Op: "quit"})
	}
}
