package stress

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"net/netip"
	"os"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// ---------------------------------------------------------------------------
// Environment: a host namespace with an underlay address, a sandbox
// directory and one driver, all removed in t.Cleanup (also when a check
// fails or the watchdog fires).

type env struct {
	host     *nstest.NS
	vtep     netip.Addr // the host's underlay address
	fixedAdv netip.Addr // the configured advertise address (invalid: learnt from DiscoverNew)
	netnsDir string
	d        *driver.Driver
	rec      *recorder
	logs     *logCapture
	underlay []string // the host namespace's links before the driver ran, as dump lines
	// kernelOnly: compareAll checks the kernel only (see runConfig).
	kernelOnly bool

	announceMu sync.Mutex
	announced  []netip.Addr // DiscoverNew Self addresses, recorded before each call
}

func newEnv(t testing.TB, fixedAdv, trace bool) *env {
	t.Helper()
	nstest.RequireRoot(t)
	hosts, vteps := nstest.Hosts(t, 1, false)
	e := &env{host: hosts[0], vtep: vteps[0], netnsDir: nstest.NetnsDir(t), rec: &recorder{}, logs: &logCapture{}}
	if os.Getenv("OVERLAYD_TEST_LOG") != "" {
		e.logs.verbose = os.Stderr
	}
	if fixedAdv {
		e.fixedAdv = e.vtep
	}
	cfg := driver.Config{
		HostNS:        e.host.Handle,
		NetnsDir:      e.netnsDir,
		AdvertiseAddr: e.fixedAdv,
		Logger:        slog.New(&capHandler{c: e.logs}),
		OnDiscover:    func(netip.Addr, bool) {},
		// Encrypted networks on a kernel with xfrm policies and nftables
		// but no ESP states: a stand-in passes the kernel check (as in
		// driver.TestEncryptedNetworkFailsClosedWithoutSAs).
		Secret:          stressSecret,
		CheckEncryption: func() error { return nil },
	}
	if trace {
		cfg.Trace = e.rec.trace
	}
	d, err := driver.New(cfg)
	if err != nil {
		t.Fatalf("driver.New: %v", err)
	}
	e.d = d
	t.Cleanup(func() { d.Close() })
	if e.underlay, err = dumpKernel(e.host.NL, e.netnsDir); err != nil {
		t.Fatalf("dumping the fresh host namespace: %v", err)
	}
	return e
}

func (e *env) announce(a netip.Addr) {
	e.announceMu.Lock()
	e.announced = append(e.announced, a)
	e.announceMu.Unlock()
}

// recorder keeps the driver's trace. The callback runs under the driver's
// linearising lock: it only appends.
type recorder struct {
	mu   sync.Mutex
	evs  []driver.TraceEvent // since the last take
	n    int                 // events taken before
	hook func(driver.TraceEvent)
}

func (r *recorder) trace(ev driver.TraceEvent) {
	if r.hook != nil {
		r.hook(ev) // tests only: runs under the driver's lock
	}
	ev = copyTrace(ev)
	r.mu.Lock()
	r.evs = append(r.evs, ev)
	r.mu.Unlock()
}

// take returns the events since the last take and the sequence number of
// the first one.
func (r *recorder) take() ([]driver.TraceEvent, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	evs, first := r.evs, r.n
	r.n += len(evs)
	r.evs = nil
	return evs, first
}

// logCapture collects the driver's warnings and errors that a correct run
// never logs (a failed delta that needed a reconcile, a failed rollback).
type logCapture struct {
	mu         sync.Mutex
	unexpected []string
	verbose    io.Writer
}

var expectedWarnings = []string{
	"CreateNetwork rejected",
	"dropping early peer that does not fit the network",
}

func (c *logCapture) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := c.unexpected
	c.unexpected = nil
	return u
}

type capHandler struct {
	c     *logCapture
	attrs []slog.Attr
}

func (h *capHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn || h.c.verbose != nil
}

func (h *capHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", r.Level, r.Message)
	for _, a := range h.attrs {
		fmt.Fprintf(&b, " %s", a)
	}
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s", a); return true })
	h.c.mu.Lock()
	defer h.c.mu.Unlock()
	if h.c.verbose != nil {
		fmt.Fprintln(h.c.verbose, b.String())
	}
	if r.Level >= slog.LevelWarn {
		for _, w := range expectedWarnings {
			if r.Level == slog.LevelWarn && r.Message == w {
				return nil
			}
		}
		h.c.unexpected = append(h.c.unexpected, b.String())
	}
	return nil
}

func (h *capHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &capHandler{c: h.c, attrs: append(slices.Clone(h.attrs), as...)}
}

func (h *capHandler) WithGroup(string) slog.Handler { return h }

// ---------------------------------------------------------------------------
// Deadlock watchdog: every operation (and every quiet-point check) runs in a
// slot; an operation in a slot for longer than the limit fires the watchdog,
// which reports the blocked operations and every goroutine's stack.

type inflight struct {
	desc  string
	start time.Time
}

type watchdog struct {
	limit time.Duration
	slots []atomic.Pointer[inflight]
	fired chan struct{}
	once  sync.Once
	msg   string
	stop  chan struct{}
}

func newWatchdog(limit time.Duration, slots int) *watchdog {
	w := &watchdog{limit: limit, slots: make([]atomic.Pointer[inflight], slots), fired: make(chan struct{}), stop: make(chan struct{})}
	go w.loop()
	return w
}

func (w *watchdog) begin(slot int, desc string) {
	w.slots[slot].Store(&inflight{desc: desc, start: time.Now()})
}

func (w *watchdog) end(slot int) { w.slots[slot].Store(nil) }

func (w *watchdog) close() { close(w.stop) }

func (w *watchdog) loop() {
	tick := time.NewTicker(w.limit / 20)
	defer tick.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-tick.C:
		}
		var blocked []string
		for i := range w.slots {
			if p := w.slots[i].Load(); p != nil && time.Since(p.start) > w.limit {
				blocked = append(blocked, fmt.Sprintf("slot %d: %s (blocked for %v)", i, p.desc, time.Since(p.start).Round(time.Millisecond)))
			}
		}
		if len(blocked) > 0 {
			w.once.Do(func() {
				w.msg = fmt.Sprintf("DEADLOCK: %d operation(s) blocked for more than %v:\n  %s\n\nall goroutines:\n%s",
					len(blocked), w.limit, strings.Join(blocked, "\n  "), allStacks())
				close(w.fired)
			})
			return
		}
	}
}

func allStacks() string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) || len(buf) >= 64<<20 {
			return string(buf[:n])
		}
		buf = make([]byte, 2*len(buf))
	}
}

// ---------------------------------------------------------------------------
// Lock-order checking: with the lockcheck tag every acquisition of the
// driver's locks is checked against the hierarchy; the harness counts
// inversions instead of panicking and fails the run on any.

type inversionCounter struct {
	n    atomic.Int64
	mu   sync.Mutex
	msgs []string
}

func (c *inversionCounter) handle(msg string) {
	c.n.Add(1)
	c.mu.Lock()
	if len(c.msgs) < 3 {
		c.msgs = append(c.msgs, msg)
	}
	c.mu.Unlock()
}

// installLockCheck replaces the violation handler for the test's duration
// and, when checking is compiled in, proves the handler is live with a
// deliberate inversion on private locks.
func installLockCheck(t testing.TB) *inversionCounter {
	t.Helper()
	c := &inversionCounter{}
	prev := lockorder.SetViolationHandler(c.handle)
	t.Cleanup(func() { lockorder.SetViolationHandler(prev) })
	if !lockorder.Enabled {
		return c
	}
	bottom := lockorder.New(lockorder.LevelDriver)
	top := lockorder.New(lockorder.LevelNetwork)
	bottom.Lock()
	top.Lock() // inversion: network.mu while holding driver.mu
	top.Unlock()
	bottom.Unlock()
	if c.n.Load() != 1 {
		t.Fatalf("lock-order checking is compiled in but a deliberate inversion was counted %d times, want 1", c.n.Load())
	}
	c.n.Store(0)
	c.msgs = nil
	return c
}

// ---------------------------------------------------------------------------
// The run.

// strictTraceOrder (default; OVERLAYD_STRICT_TRACE=0 turns it off) fails a
// run in which the model had to infer a deletion because the driver traced
// DeleteNetwork after events that depend on it (see model.inferDelete). The
// driver emits that event under driver.mu, so this must never happen.
var strictTraceOrder = os.Getenv("OVERLAYD_STRICT_TRACE") != "0"

type runConfig struct {
	seed      int64
	workers   int
	ops       int64         // stop after this many operations (0: use duration)
	duration  time.Duration // stop after this long (soak)
	phaseOps  int           // operations per worker between quiet points
	watchdog  time.Duration
	fixedAdv  bool // configure the advertise address (else learn it from DiscoverNew)
	universe  func(localVTEP netip.Addr) *universe
	mix       *opMix                  // overrides the universe's mix
	traceHook func(driver.TraceEvent) // called under the driver's lock (watchdog test)
	// kernelOnly judges by the model against the kernel dumps alone: no
	// Audit (concurrent or at quiet points), no Status, no EndpointInfo —
	// to prove that the model catches a bug without the driver's help.
	kernelOnly bool
	label      string // extra words for the report (the injected fault)
	teardown   bool   // delete every network at the end and check nothing is left
	keepTrace  bool   // keep the trace file even if the run is clean
}

type runResult struct {
	ops       int64
	elapsed   time.Duration
	phases    int
	failed    bool
	report    string   // the failure report
	diffs     []string // the differences of the failing quiet point
	deadlock  bool
	stats     modelStats
	inferred  []string // trace events the model had to reorder (see model.inferDelete)
	keys      keysStats
	traceFile string
}

type harness struct {
	cfg  runConfig
	e    *env
	u    *universe
	m    *model
	wd   *watchdog
	inv  *inversionCounter
	ops  atomic.Int64
	stop atomic.Bool
	gz   *gzip.Writer
	tw   *bufio.Writer // the linearised trace of the whole run (see runStress)

	mu         sync.Mutex
	unexpected []string // operations whose outcome was impossible
	oplog      [][]string
	phaseTrace []driver.TraceEvent
	phaseFirst int

	keysRng   *rand.Rand // the key states probeKeys sets
	keysStats keysStats
}

// runStress runs the seeded workload and checks every quiet point; it
// returns the outcome rather than failing t, so that tests can expect a
// failure (faults) as well as a clean run.
func runStress(t testing.TB, cfg runConfig) *runResult {
	t.Helper()
	if cfg.watchdog == 0 {
		cfg.watchdog = 10 * time.Second
	}
	if cfg.universe == nil {
		cfg.universe = stressUniverse
	}
	inv := installLockCheck(t)
	e := newEnv(t, cfg.fixedAdv, true)
	e.rec.hook = cfg.traceHook
	h := &harness{cfg: cfg, e: e, u: cfg.universe(e.vtep), m: newModel(e.fixedAdv), inv: inv}
	if cfg.mix != nil {
		h.u.mix = *cfg.mix
	}
	if cfg.kernelOnly {
		h.u.mix.audit = 0
		h.e.kernelOnly = true
	}
	if !cfg.fixedAdv {
		h.u.plainOnly()
	}
	h.keysRng = rand.New(rand.NewSource(cfg.seed))
	h.wd = newWatchdog(cfg.watchdog, cfg.workers+1)
	defer h.wd.close()
	// The linearised trace of the whole run, gzipped JSON lines: kept when
	// the run fails, for the sequential replay.
	f, err := os.CreateTemp("", fmt.Sprintf("overlayd-stress-%d-*.trace.gz", cfg.seed))
	if err != nil {
		t.Fatal(err)
	}
	h.gz = gzip.NewWriter(f)
	h.tw = bufio.NewWriter(h.gz)
	res := &runResult{traceFile: f.Name()}
	t.Cleanup(func() {
		h.tw.Flush()
		h.gz.Close()
		f.Close()
		if !res.failed {
			os.Remove(f.Name())
		}
	})

	gens := make([]*gen, cfg.workers)
	for w := range gens {
		gens[w] = newGen(h.u, cfg.seed*1_000_003+int64(w)*7919, e.announce)
	}
	start := time.Now()
	more := func() bool {
		if cfg.ops > 0 {
			return h.ops.Load() < cfg.ops
		}
		return time.Since(start) < cfg.duration
	}
	for phase := 1; more(); phase++ {
		per := cfg.phaseOps
		if cfg.ops > 0 {
			if left := int((cfg.ops - h.ops.Load() + int64(cfg.workers) - 1) / int64(cfg.workers)); left < per {
				per = left
			}
		}
		h.oplog = make([][]string, cfg.workers)
		var wg sync.WaitGroup
		for w := 0; w < cfg.workers; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				for i := 0; i < per && !h.stop.Load(); i++ {
					o := gens[w].next()
					h.wd.begin(w, o.desc)
					err := o.run(e.d)
					h.wd.end(w)
					h.ops.Add(1)
					res := "ok"
					if err != nil {
						res = "error: " + err.Error()
					}
					line := fmt.Sprintf("w%02d.%d %s => %s", w, i, o.desc, res)
					h.oplog[w] = append(h.oplog[w], line)
					if !o.ok(err) {
						h.mu.Lock()
						h.unexpected = append(h.unexpected, "impossible outcome: "+line)
						h.mu.Unlock()
					}
				}
			}(w)
		}
		if !h.wait(t, &wg) {
			return h.deadlock(res, phase, start, false)
		}
		res.phases = phase
		diffs, ok := h.quietPoint(t)
		if !ok {
			return h.deadlock(res, phase, start, true)
		}
		if len(diffs) > 0 {
			return h.fail(res, phase, start, diffs)
		}
	}
	if cfg.teardown {
		// Delete every network, the same ids from several goroutines at once.
		var wg sync.WaitGroup
		for w := 0; w < min(cfg.workers, 4); w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				ids := slices.Clone(h.u.nets)
				rng := gens[w].rng
				rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
				for _, id := range ids {
					h.wd.begin(w, "teardown DeleteNetwork "+id)
					err := e.d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: id})
					h.wd.end(w)
					h.ops.Add(1)
					if err != nil {
						h.mu.Lock()
						h.unexpected = append(h.unexpected, fmt.Sprintf("impossible outcome: teardown DeleteNetwork %s => %v", id, err))
						h.mu.Unlock()
					}
				}
			}(w)
		}
		h.oplog = nil
		if !h.wait(t, &wg) {
			return h.deadlock(res, res.phases+1, start, false)
		}
		res.phases++
		diffs, ok := h.quietPoint(t)
		if !ok {
			return h.deadlock(res, res.phases, start, true)
		}
		if len(h.m.nets) != 0 {
			diffs = append(diffs, fmt.Sprintf("after deleting every network the model still has %d", len(h.m.nets)))
		}
		if len(diffs) > 0 {
			return h.fail(res, res.phases, start, diffs)
		}
	}
	res.ops, res.elapsed, res.stats, res.inferred, res.keys = h.ops.Load(), time.Since(start), h.m.stats, h.m.inferred, h.keysStats
	return res
}

// wait waits for the workers; false if the watchdog fired. Then the
// workers still blocked may resume later: a cleanup (which runs before the
// driver is closed and the namespaces are removed) gives them time to
// finish, so that none runs against a closed driver.
func (h *harness) wait(t testing.TB, wg *sync.WaitGroup) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-h.wd.fired:
		h.stop.Store(true)
		t.Cleanup(func() {
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Logf("workers still blocked 30 s after the watchdog fired; cleaning up regardless")
			}
		})
		return false
	}
}

// quietPoint feeds the trace since the last quiet point to the model and
// compares the model, the kernel and the driver's own views. ok is false if
// the watchdog fired during the check.
func (h *harness) quietPoint(t testing.TB) ([]string, bool) {
	done := make(chan []string, 1)
	go func() {
		slot := h.cfg.workers
		h.wd.begin(slot, "quiet-point check (trace, dumps, Audit, EndpointInfo)")
		diffs := h.check()
		h.wd.end(slot)
		done <- diffs
	}()
	select {
	case diffs := <-done:
		return diffs, true
	case <-h.wd.fired:
		h.stop.Store(true)
		t.Cleanup(func() {
			select {
			case <-done:
			case <-time.After(30 * time.Second):
			}
		})
		return nil, false
	}
}

func (h *harness) check() []string {
	var diffs []string
	evs, first := h.e.rec.take()
	h.phaseTrace, h.phaseFirst = evs, first
	h.writeTrace(evs)
	h.e.announceMu.Lock()
	for _, a := range h.e.announced {
		h.m.advertised[a] = true
	}
	h.e.announceMu.Unlock()
	for i, ev := range evs {
		if ev.Kind == driver.TraceCreateNetwork {
			enc, err := h.u.checkCreate(ev)
			if err != nil {
				diffs = append(diffs, "trace: "+err.Error())
			}
			h.m.nextEncrypted = enc
		}
		h.m.seq = first + i
		if err := h.m.apply(ev); err != nil {
			diffs = append(diffs, fmt.Sprintf("trace #%d is not a possible sequential history: %v", first+i, err))
		}
		h.m.nextEncrypted = false
	}
	if err := h.m.settled(); err != nil {
		diffs = append(diffs, "trace: "+err.Error())
	}
	if strictTraceOrder && h.m.stats.inferredDeletes > 0 {
		diffs = append(diffs, fmt.Sprintf("trace: %d DeleteNetwork event(s) traced after events that depend on them (OVERLAYD_STRICT_TRACE):\n  %s",
			h.m.stats.inferredDeletes, strings.Join(h.m.inferred, "\n  ")))
	}
	diffs = append(diffs, compareAll(h.e, h.m, h.u)...)
	if len(diffs) == 0 && !h.e.kernelOnly {
		diffs = append(diffs, h.probeKeys()...)
	}
	h.mu.Lock()
	diffs = append(diffs, h.unexpected...)
	h.unexpected = nil
	h.mu.Unlock()
	for _, l := range h.e.logs.take() {
		diffs = append(diffs, "driver logged: "+l)
	}
	if n := h.inv.n.Load(); n > 0 {
		h.inv.mu.Lock()
		diffs = append(diffs, fmt.Sprintf("%d lock-order inversion(s); first:\n%s", n, strings.Join(h.inv.msgs, "\n---\n")))
		h.inv.mu.Unlock()
	}
	return diffs
}

// compareAll compares the model with the kernel (netlink dumps), with the
// driver's Audit and with the driver's view of every endpoint.
func compareAll(e *env, m *model, u *universe) []string {
	var diffs []string
	have, err := dumpKernel(e.host.NL, e.netnsDir)
	if err != nil {
		diffs = append(diffs, "dumping the kernel: "+err.Error())
	} else {
		for _, l := range diffLines(m.desired(e.underlay), have) {
			diffs = append(diffs, "kernel vs model: "+l)
		}
	}
	diffs = append(diffs, compareEncryption(e, m, nil)...)
	if e.kernelOnly {
		return diffs
	}
	diffs = append(diffs, compareStatus(e, m)...)
	problems, err := e.d.Audit()
	if err != nil {
		diffs = append(diffs, "driver Audit: "+err.Error())
	}
	for _, p := range problems {
		diffs = append(diffs, "driver Audit: "+p)
	}
	// The driver's view of the endpoints (EndpointInfo) against the model.
	var nets, eps []string
	if u != nil {
		nets, eps = u.nets, u.endpoints
	} else {
		for id, n := range m.nets {
			nets = append(nets, id)
			for ep := range n.eps {
				eps = append(eps, ep)
			}
		}
	}
	for _, id := range nets {
		for _, ep := range eps {
			resp, err := e.d.EndpointInfo(&api.InfoRequest{NetworkID: id, EndpointID: ep})
			var mep *mEndpoint
			n := m.nets[id]
			if n != nil {
				mep = n.eps[ep]
			}
			switch {
			case mep == nil && err == nil:
				diffs = append(diffs, fmt.Sprintf("driver view: endpoint %s/%s exists (%v), the model has none", id, ep, resp.Value))
			case mep == nil:
				if !driver.IsNotFound(err) {
					diffs = append(diffs, fmt.Sprintf("driver view: EndpointInfo %s/%s: %v", id, ep, err))
				}
			case err != nil:
				diffs = append(diffs, fmt.Sprintf("driver view: endpoint %s/%s: %v, the model has %s", id, ep, err, mep.addr))
			default:
				host, _ := vethNames(id, ep)
				want := map[string]string{"address": mep.addr.String(), "mac": mep.mac.String(), "vni": fmt.Sprint(n.subnets[mep.subnet].vni), "veth": host}
				for k, v := range want {
					if resp.Value[k] != v {
						diffs = append(diffs, fmt.Sprintf("driver view: endpoint %s/%s %s=%q, the model has %q", id, ep, k, resp.Value[k], v))
					}
				}
			}
		}
	}
	return diffs
}

// deadlock reports a fired watchdog. If it fired during a quiet-point
// check, that check may still be running: the model and the trace file are
// left alone (the trace file misses the last phase).
func (h *harness) deadlock(res *runResult, phase int, start time.Time, inCheck bool) *runResult {
	if !inCheck {
		h.flushTrace()
		res.stats = h.m.stats
	}
	res.failed, res.deadlock = true, true
	res.ops, res.elapsed, res.phases = h.ops.Load(), time.Since(start), phase
	res.report = fmt.Sprintf("stress: seed %d%s: %s\n%s", h.cfg.seed, h.cfg.label, h.wd.msg, h.replayHelp(res))
	return res
}

func (h *harness) replayHelp(res *runResult) string {
	tags := "lockcheck"
	if driver.FaultsAvailable {
		tags += " faultinject"
	}
	return fmt.Sprintf("replay this run:  OVERLAYD_SEED=%d OVERLAYD_WORKERS=%d go test -race -tags '%s' -run '^TestStress$' -v ./test/stress\n"+
		"replay its linearised trace sequentially (stops at the first divergence, then shrinks to the networks involved):\n"+
		"                  OVERLAYD_REPLAY=%s go test -tags '%s' -run '^TestReplay$' -v ./test/stress\n",
		h.cfg.seed, h.cfg.workers, tags, res.traceFile, tags)
}

// flushTrace writes what the model has not seen yet, so that the trace
// file of a failed run is complete.
func (h *harness) flushTrace() {
	evs, _ := h.e.rec.take()
	h.writeTrace(evs)
}

func (h *harness) writeTrace(evs []driver.TraceEvent) {
	enc := json.NewEncoder(h.tw)
	for _, ev := range evs {
		enc.Encode(ev)
	}
	h.tw.Flush()
	h.gz.Flush()
}

var idWord = regexp.MustCompile(`[A-Za-z0-9_.-]+`)

func (h *harness) fail(res *runResult, phase int, start time.Time, diffs []string) *runResult {
	h.flushTrace()
	res.failed, res.diffs = true, diffs
	res.ops, res.elapsed, res.phases, res.stats = h.ops.Load(), time.Since(start), phase, h.m.stats

	// The networks the differences name, and their VNIs, to cut the logs.
	nets := map[string]bool{}
	veths := map[string]string{}
	for _, id := range h.u.nets {
		for _, ep := range h.u.endpoints {
			hn, sn := vethNames(id, ep)
			veths[hn], veths[sn] = id, id
		}
	}
	for _, d := range diffs {
		for _, w := range idWord.FindAllString(d, -1) {
			if slices.Contains(h.u.nets, w) {
				nets[w] = true
			}
			if id, ok := veths[w]; ok {
				nets[id] = true
			}
		}
	}
	vnis := map[uint32]bool{}
	for id := range nets {
		for _, s := range h.u.specs[id] {
			for _, v := range s.vnis {
				vnis[v] = true
			}
		}
	}
	relevant := func(ev driver.TraceEvent) bool {
		if len(nets) == 0 || nets[ev.Network] || vnis[ev.VNI] && ev.VNI != 0 {
			return true
		}
		for _, v := range ev.VNIs {
			if vnis[v] {
				return true
			}
		}
		return false
	}
	var b strings.Builder
	fmt.Fprintf(&b, "stress: DIVERGENCE at quiet point %d after %d operations in %v (seed %d, %d workers%s)\n",
		phase, res.ops, res.elapsed.Round(time.Millisecond), h.cfg.seed, h.cfg.workers, h.cfg.label)
	b.WriteString(h.replayHelp(res))
	fmt.Fprintf(&b, "\n%d difference(s):\n", len(diffs))
	for i, d := range diffs {
		if i == 80 {
			fmt.Fprintf(&b, "  ... %d more\n", len(diffs)-i)
			break
		}
		fmt.Fprintf(&b, "  %s\n", d)
	}
	var ids []string
	for id := range nets {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var lines []string
	for i, ev := range h.phaseTrace {
		if relevant(ev) {
			lines = append(lines, fmt.Sprintf("#%d %s", h.phaseFirst+i, fmtTrace(ev)))
		}
	}
	fmt.Fprintf(&b, "\nlinearised trace since the previous quiet point (the state there was verified), events concerning networks %v: %d of %d\n",
		ids, len(lines), len(h.phaseTrace))
	writeTail(&b, lines, 300)
	var ops []string
	for _, wl := range h.oplog {
		for _, l := range wl {
			if len(nets) == 0 || mentions(l, nets, vnis) {
				ops = append(ops, l)
			}
		}
	}
	fmt.Fprintf(&b, "\noperations issued since the previous quiet point that concern them (per worker, in issue order): %d\n", len(ops))
	writeTail(&b, ops, 200)
	for _, id := range ids {
		fmt.Fprintf(&b, "\nmodel state of %s:\n", id)
		writeTail(&b, h.m.describe(id), 100)
	}
	fmt.Fprintf(&b, "\nmodel: %s\n", h.m.stats)
	res.report = b.String()
	return res
}

func mentions(line string, nets map[string]bool, vnis map[uint32]bool) bool {
	for _, w := range idWord.FindAllString(line, -1) {
		if nets[w] {
			return true
		}
	}
	for v := range vnis {
		if strings.Contains(line, fmt.Sprintf("vni=%d ", v)) {
			return true
		}
	}
	return strings.Contains(line, "Audit")
}

func writeTail(b *strings.Builder, lines []string, max int) {
	if len(lines) > max {
		fmt.Fprintf(b, "  ... %d earlier lines left out\n", len(lines)-max)
		lines = lines[len(lines)-max:]
	}
	for _, l := range lines {
		fmt.Fprintf(b, "  %s\n", l)
	}
}
