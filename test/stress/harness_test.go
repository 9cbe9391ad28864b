//go:build testhooks

package stress

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/testutil/keyhub"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/solo"
	"github.com/overlayd/overlayd/peerdb"
)

// ---------------------------------------------------------------------------
// Environment: a host namespace with an underlay address, a sandbox
// directory, the control plane's stand-in (the source of remote records and
// the publisher of local ones), an encryption owner and one driver, all
// removed in t.Cleanup (also when a check fails or the watchdog fires).

type env struct {
	host     *nstest.NS
	vtep     netip.Addr // the host's underlay address
	fixedAdv netip.Addr // the configured advertise address (invalid: learnt from DiscoverNew)
	netnsDir string
	d        *driver.Driver
	src      *source
	owner    *encryption.Owner
	pub      *publisher
	rec      *recorder
	logs     *logCapture
	underlay []string // the host namespace's links before the driver ran, as dump lines
	// kernelOnly: compareAll checks the kernel only (see runConfig).
	kernelOnly bool
	// keys: the owner is attached to a gossip hub once the local VTEP is
	// known (as the daemon starts its control plane then), and then
	// establishes its keys (epoch 1).
	keys   bool
	attach sync.Once

	announceMu sync.Mutex
	announced  []netip.Addr // DiscoverNew Self addresses, recorded before each call
}

// newEnv makes the environment. With trace, the driver's trace is
// recorded (and the source remembers what each pull read); with keys, the
// encryption owner is attached to a lone gossip hub as soon as the local
// VTEP is known (at once with a configured address, else at the first
// DiscoverNew Self), as a daemon alone in its cluster, and establishes
// epoch 1; with a configured address newEnv waits until it has.
func newEnv(t testing.TB, fixedAdv, trace, keys bool) *env {
	t.Helper()
	nstest.RequireRoot(t)
	hosts, vteps := nstest.Hosts(t, 1, false)
	e := &env{host: hosts[0], vtep: vteps[0], netnsDir: nstest.NetnsDir(t), src: newSource(trace), pub: newPublisher(),
		logs: &logCapture{}, keys: keys}
	e.rec = &recorder{src: e.src}
	if os.Getenv("OVERLAYD_TEST_LOG") != "" {
		e.logs.verbose = os.Stderr
	}
	if fixedAdv {
		e.fixedAdv = e.vtep
	}
	// The encryption owner, as the daemon makes it: this kernel has xfrm
	// policies and nftables but no ESP states, so a stand-in passes the
	// kernel check (as in driver.TestEncryptedNetworkFailsClosedWithoutSAs)
	// and the owner finds out, and reports, when it first adds an SA.
	o, err := encryption.NewOwner(encryption.OwnerConfig{NS: e.host.Handle, Port: driver.DefaultVXLANPort, Secret: stressSecret,
		Logger:      slog.New(&capHandler{c: e.logs, attrs: []slog.Attr{slog.String("component", "encryption")}}),
		CheckKernel: func() error { return nil }})
	if err != nil {
		t.Fatalf("encryption.NewOwner: %v", err)
	}
	t.Cleanup(o.Close) // after the driver's Close (cleanups run last first)
	e.owner = o
	cfg := driver.Config{
		HostNS:        e.host.Handle,
		NetnsDir:      e.netnsDir,
		AdvertiseAddr: e.fixedAdv,
		Logger:        slog.New(&capHandler{c: e.logs}),
		Peers:         e.src,
		// As the daemon's clusterLink.VTEPChanged: the encryption state
		// follows the VTEP.
		Publisher: localPublisher{publisher: e.pub, vtepChanged: func(a netip.Addr) {
			e.logs.noteErr("encryption SetLocal("+a.String()+") on a VTEP change", o.SetLocal(a))
			e.attachGossip()
		}},
		// A host alone for definitions and membership (the model has
		// one host), whose control plane runs: the swarm leader's
		// AllocateNetwork answers carry its own gossip address.
		Definitions: solo.ControlPlane{},
		Membership:  runningAlone{seed: "192.0.2.250:7947"},
		Encryption:  o,
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
	if v := d.VTEP(); v.IsValid() {
		e.logs.noteErr("encryption SetLocal("+v.String()+")", o.SetLocal(v))
	}
	o.Start()
	if keys && d.VTEP().IsValid() {
		e.attachGossip()
		if err := e.waitKeys(10 * time.Second); err != nil {
			t.Fatalf("encryption owner attached to a lone gossip hub: %v", err)
		}
	}
	if e.underlay, err = dumpKernel(e.host.NL, e.netnsDir); err != nil {
		t.Fatalf("dumping the fresh host namespace: %v", err)
	}
	return e
}

// attachGossip attaches the encryption owner to a lone gossip hub (once,
// with keys): the owner bootstraps epoch 1 through it.
func (e *env) attachGossip() {
	if e.keys {
		e.attach.Do(func() { keyhub.New().Attach(e.vtep, e.owner) })
	}
}

// waitKeys waits until the owner has established and advertised epoch 1
// (it needs the local VTEP for that).
func (e *env) waitKeys(limit time.Duration) error {
	return nstest.Eventually(limit, 5*time.Millisecond, func() error {
		if st := e.owner.Status(); st.Send != 1 || !slices.Equal(st.Accept, []uint32{1}) || st.Target != 1 || !st.Advertised {
			return fmt.Errorf("keys not established: send %d accept %v target %d advertised %v gossip %v local %v error %q last error %q",
				st.Send, st.Accept, st.Target, st.Advertised, st.GossipAttached, st.Local, st.Error, st.LastError)
		}
		return nil
	})
}

func (e *env) announce(a netip.Addr) {
	e.announceMu.Lock()
	e.announced = append(e.announced, a)
	e.announceMu.Unlock()
}

// publisher is the control plane's other half: it keeps the local records
// the driver publishes (PublishLocalPeer, called under a network lock, so
// its lock is at LevelClusterLocal like the cluster's) and notes every
// call that is not a possible sequence (a withdrawal of a record that was
// not published, a record published twice, a record with a VTEP of its
// own).
type publisher struct {
	mu   *lockorder.Mutex
	recs map[pubKey]peerdb.Peer // guarded by mu
	bad  []string               // guarded by mu
}

type pubKey struct {
	vni uint32
	ep  string
}

// localPublisher is the harness's driver.LocalPublisher: the records go
// to the publisher, a VTEP change to vtepChanged; names are not modelled.
type localPublisher struct {
	*publisher
	vtepChanged func(netip.Addr)
}

func (p localPublisher) VTEPChanged(a netip.Addr) { p.vtepChanged(a) }

func (localPublisher) PublishLocalNames(uint32, string, string) error { return nil }

// runningAlone is the Membership of a host alone whose control plane has
// started: its gossip seeds are its own address.
type runningAlone struct {
	solo.ControlPlane
	seed string
}

func (m runningAlone) GossipSeeds() []string { return []string{m.seed} }

func newPublisher() *publisher {
	return &publisher{mu: lockorder.New(lockorder.LevelClusterLocal), recs: map[pubKey]peerdb.Peer{}}
}

func (p *publisher) PublishLocalPeer(vni uint32, prev, next *peerdb.Peer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case prev == nil && next != nil:
		k := pubKey{vni, next.EndpointID}
		if cur, ok := p.recs[k]; ok {
			p.bad = append(p.bad, fmt.Sprintf("published %s on VNI %d while %s is published", fmtPeer(next), vni, fmtPeer(&cur)))
		}
		if next.VTEP.IsValid() {
			p.bad = append(p.bad, fmt.Sprintf("published %s on VNI %d with a VTEP of its own (the control plane stamps its own)", fmtPeer(next), vni))
		}
		p.recs[k] = *next
	case prev != nil && next == nil:
		k := pubKey{vni, prev.EndpointID}
		if cur, ok := p.recs[k]; !ok || cur != *prev {
			p.bad = append(p.bad, fmt.Sprintf("withdrew %s on VNI %d, which is not what was published (%v)", fmtPeer(prev), vni, fmtPeer(&cur)))
		}
		delete(p.recs, k)
	default:
		p.bad = append(p.bad, fmt.Sprintf("PublishLocalPeer(%d, %s, %s): want exactly one of prev and next", vni, fmtPeer(prev), fmtPeer(next)))
	}
}

// lines renders the published records (and takes the bad calls).
func (p *publisher) lines() (lines, bad []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, r := range p.recs {
		lines = append(lines, fmt.Sprintf("local vni=%d %s", k.vni, fmtPeer(&r)))
	}
	bad, p.bad = p.bad, nil
	sort.Strings(lines)
	return lines, bad
}

// recorder keeps the driver's trace. The callback runs under the driver's
// linearising lock: it only appends (and, for a pull, takes from the
// source what the pull read: the source's lock is below the network's).
type recorder struct {
	src  *source
	mu   sync.Mutex
	evs  []tev // since the last take
	n    int   // events taken before
	hook func(driver.TraceEvent)
}

func (r *recorder) trace(ev driver.TraceEvent) {
	if r.hook != nil {
		r.hook(ev) // tests only: runs under the driver's lock
	}
	t := tev{TraceEvent: copyTrace(ev)}
	if ev.Kind == driver.TracePull {
		t.Full, t.Read = r.src.takeReads(ev.VNI)
	}
	r.mu.Lock()
	r.evs = append(r.evs, t)
	r.mu.Unlock()
}

// take returns the events since the last take and the sequence number of
// the first one.
func (r *recorder) take() ([]tev, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	evs, first := r.evs, r.n
	r.n += len(evs)
	r.evs = nil
	return evs, first
}

// logCapture collects the warnings and errors of the driver and of the
// encryption owner that a correct run never logs (a failed delta that
// needed a reconcile, a failed rollback, a repair of encryption state that
// nobody changed behind the owner's back).
type logCapture struct {
	mu         sync.Mutex
	unexpected []string
	verbose    io.Writer
}

// expectedWarnings are logged by a correct driver in this workload: a
// CreateNetwork with invalid options, an explicit MTU that cannot be checked
// against the underlay before DiscoverNew gave the VTEP, a record the source
// holds that a network refuses (it stays at the source and is listed in
// Status), a VTEP that DiscoverNew moves to another address, an address
// claimed on several hosts, the dnsrr notice of an allocated swarm network.
var expectedWarnings = []string{
	"CreateNetwork rejected",
	"cannot check the MTU of a new network against the underlay: no VTEP yet",
	"refusing a remote peer record (it stays with the control plane and is taken when valid)",
	"local VTEP changed: local endpoints are re-announced with the new address",
	driver.ConflictWarning, // the workload claims addresses on several hosts
	driver.DNSRRWarning,    // the workload allocates swarm networks
}

// kernelWarnings are warnings a correct encryption owner logs on a kernel
// that cannot install ESP states (when it first finds out, and again after
// each retry a minute later); unexpected on a kernel that can.
var kernelWarnings = []string{
	encryption.ESPUnsupportedWarning,
}

func (c *logCapture) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	u := c.unexpected
	c.unexpected = nil
	return u
}

// noteErr records the error of a call the harness makes as the daemon
// would (and logs there): unexpected.
func (c *logCapture) noteErr(what string, err error) {
	if err == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.unexpected = append(c.unexpected, fmt.Sprintf("%s: %v", what, err))
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
		for _, m := range kernelWarnings {
			if r.Level == slog.LevelWarn && r.Message == m && !espKernel() {
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
		var blocked, others []string
		for i := range w.slots {
			if p := w.slots[i].Load(); p != nil {
				l := fmt.Sprintf("slot %d: %s (for %v)", i, p.desc, time.Since(p.start).Round(time.Millisecond))
				if time.Since(p.start) > w.limit {
					blocked = append(blocked, l)
				} else {
					others = append(others, l)
				}
			}
		}
		if len(blocked) > 0 {
			// The others in flight too: the operation that holds what the
			// blocked ones wait for may have started later.
			w.once.Do(func() {
				w.msg = fmt.Sprintf("DEADLOCK: %d operation(s) blocked for more than %v:\n  %s\nother operations in flight:\n  %s\n\nall goroutines:\n%s",
					len(blocked), w.limit, strings.Join(blocked, "\n  "), strings.Join(others, "\n  "), allStacks())
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
	//lint:ignore SA2001 the lock is taken only to have the inversion counted
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
	// noKeys: the encryption owner is attached to no gossip, so it never
	// has keys (every policy points at no SA), as a daemon before its
	// control plane started.
	noKeys bool
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
	enc       encStats
	work      workStats
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
	phaseTrace []tev
	phaseFirst int

	gens            []*gen
	enc             encStats
	quietReconciles int // Reconcile calls at quiet points after lost notifications
	// specOf is the spec of each network id's last traced CreateNetwork
	// (enrich; only the quiet-point check uses it, workers paused).
	specOf map[string]*netSpec
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
	e := newEnv(t, cfg.fixedAdv, true, !cfg.noKeys)
	e.rec.hook = cfg.traceHook
	h := &harness{cfg: cfg, e: e, u: cfg.universe(e.vtep), m: newModel(), inv: inv}
	if cfg.mix != nil {
		h.u.mix = *cfg.mix
	}
	if cfg.kernelOnly {
		// The driver's own checks and repairs are left out: Audit, and
		// Reconcile (concurrent, or after a lost notification), which
		// would repair what an injected fault breaks.
		h.u.mix.audit, h.u.mix.reconcile = 0, 0
		h.u.noLost = true
		h.e.kernelOnly = true
	}
	if !cfg.fixedAdv {
		h.u.plainOnly()
	}
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
		gens[w] = newGen(h.u, e.src, cfg.seed*1_000_003+int64(w)*7919, e.announce)
	}
	h.gens = gens
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
					desc := o.desc
					if o.detail != nil && *o.detail != "" {
						desc += ":" + *o.detail
					}
					line := fmt.Sprintf("w%02d.%d %s => %s", w, i, desc, res)
					h.oplog[w] = append(h.oplog[w], line)
					switch {
					case o.ok(err):
					default:
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
	res.ops, res.elapsed, res.stats, res.inferred = h.ops.Load(), time.Since(start), h.m.stats, h.m.inferred
	h.finishStats(res)
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
	if lost := h.e.src.takeLost(); lost > 0 && !h.e.kernelOnly {
		// Some changes were never notified: the daemon's periodic
		// reconcile (full pull, then kernel dump and diff) repairs them.
		// Its pulls program the differences, so the dump and diff find
		// nothing left to fix.
		h.quietReconciles++
		fixed, err := h.e.d.Reconcile()
		if err != nil {
			diffs = append(diffs, fmt.Sprintf("Reconcile after %d lost notification(s): %v", lost, err))
		}
		for _, f := range fixed {
			diffs = append(diffs, fmt.Sprintf("Reconcile after %d lost notification(s) fixed the kernel after its own pulls: %s", lost, f))
		}
	}
	evs, first := h.e.rec.take()
	diffs = append(diffs, h.enrich(evs)...)
	h.phaseTrace, h.phaseFirst = evs, first
	h.writeTrace(evs)
	for i, ev := range evs {
		h.m.seq = first + i
		if err := h.m.apply(ev); err != nil {
			diffs = append(diffs, fmt.Sprintf("trace #%d is not a possible sequential history: %v", first+i, err))
		}
	}
	if err := h.m.settled(); err != nil {
		diffs = append(diffs, "trace: "+err.Error())
	}
	if strictTraceOrder && h.m.stats.inferredDeletes > 0 {
		diffs = append(diffs, fmt.Sprintf("trace: %d DeleteNetwork event(s) traced after events that depend on them (OVERLAYD_STRICT_TRACE):\n  %s",
			h.m.stats.inferredDeletes, strings.Join(h.m.inferred, "\n  ")))
	}
	// The level-triggered contract: with every operation returned, each
	// network holds what the source has for its VNIs.
	h.m.syncRemotes(h.e.src.snapshot())
	// Leaves hand their deletions (veths, sandboxes) to the driver's
	// reaper: the driver's Audit must find nothing wrong while they are
	// pending; the model is the state once they are done.
	if !h.e.kernelOnly {
		problems, err := h.e.d.Audit()
		if err != nil {
			diffs = append(diffs, "driver Audit with deletions pending: "+err.Error())
		}
		for _, p := range filterAudit(h.e, "encryption: ", problems, nil) {
			diffs = append(diffs, "driver Audit with deletions pending: "+p)
		}
	}
	h.e.d.WaitDeletions()
	diffs = append(diffs, compareAll(h.e, h.m, h.u, &h.enc)...)
	h.mu.Lock()
	diffs = append(diffs, h.unexpected...)
	h.unexpected = nil
	h.mu.Unlock()
	for _, l := range h.e.logs.take() {
		diffs = append(diffs, "logged: "+l)
	}
	if n := h.inv.n.Load(); n > 0 {
		h.inv.mu.Lock()
		diffs = append(diffs, fmt.Sprintf("%d lock-order inversion(s); first:\n%s", n, strings.Join(h.inv.msgs, "\n---\n")))
		h.inv.mu.Unlock()
	}
	return diffs
}

// finishStats copies the counters of a run whose workers all returned.
func (h *harness) finishStats(res *runResult) {
	for _, g := range h.gens {
		res.work.add(g.count)
	}
	res.enc = h.enc
	res.work.quietReconciles = h.quietReconciles
}

// enrich checks each traced CreateNetwork against the workload's requests
// (checkCreate) and adds to the events the IPv6 side of the requests that
// the trace does not carry (see tev): a network's IPv6 subnets and
// gateways from its spec, an endpoint's IPv6 address from its spec and
// IPv4 address (addr6For). It returns the trace's differences.
func (h *harness) enrich(evs []tev) []string {
	var diffs []string
	if h.specOf == nil {
		h.specOf = map[string]*netSpec{}
	}
	for i := range evs {
		ev := &evs[i]
		switch ev.Kind {
		case driver.TraceCreateNetwork:
			s, err := h.u.checkCreate(ev.TraceEvent)
			if err != nil {
				diffs = append(diffs, "trace: "+err.Error())
			}
			// A CreateNetwork of an id replaces what a DeleteNetwork of it
			// (traced before, or late with OVERLAYD_STRICT_TRACE=0) left.
			h.specOf[ev.Network] = s
			if s == nil || len(s.pools6) == 0 {
				continue
			}
			for j := range s.pools6 {
				ev.SpecGateways6 = append(ev.SpecGateways6, s.gateway6(j))
			}
		case driver.TraceCreateEndpoint:
			if s := h.specOf[ev.Network]; s != nil && len(s.pools6) > 0 {
				v4 := ev.Addr.Addr()
				if !v4.Is4() {
					v4 = netip.Addr{}
				}
				ev.SpecAddr6 = addr6For(s, v4, ev.Endpoint)
			}
		}
	}
	return diffs
}

// compareAll compares the model with the kernel (netlink dumps: links,
// neighbours, FDB, nftables and xfrm) and, unless kernelOnly, with the
// driver's and the encryption owner's own views: Status, Audit,
// EndpointInfo, the published local records, the VTEP. es (may be nil)
// counts the encryption checks.
func compareAll(e *env, m *model, u *universe, es *encStats) []string {
	if es == nil {
		es = &encStats{}
	}
	var diffs []string
	have, err := dumpKernel(e.host.NL, e.netnsDir)
	if err != nil {
		diffs = append(diffs, "dumping the kernel: "+err.Error())
	} else {
		for _, l := range diffLines(m.desired(e.underlay), have) {
			diffs = append(diffs, "kernel vs model: "+l)
		}
	}
	local := e.d.VTEP()
	diffs = append(diffs, compareEncryption(e, m, local, es)...)
	if e.kernelOnly {
		return diffs
	}
	diffs = append(diffs, compareStatus(e, m)...)
	diffs = append(diffs, compareOwner(e, m, local, es)...)
	problems, err := e.d.Audit()
	if err != nil {
		diffs = append(diffs, "driver Audit: "+err.Error())
	}
	for _, p := range filterAudit(e, "encryption: ", problems, es) {
		diffs = append(diffs, "driver Audit: "+p)
	}
	diffs = append(diffs, compareLocal(e, m, local)...)
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
				// With IPv6: "v4,v6", or "v6" for an IPv6-only endpoint.
				switch {
				case !mep.addr.IsValid():
					want["address"] = mep.addr6.String()
				case mep.addr6.IsValid():
					want["address"] = mep.addr.String() + "," + mep.addr6.String()
				}
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

// compareLocal checks the local side against the model: the records the
// driver published (and LocalPeers, what the daemon re-publishes from) are
// exactly the joined endpoints, each under the VNI of its subnet and
// without a VTEP of its own; the driver's VTEP is the configured one, or
// the last one DiscoverNew announced (none before the first).
func compareLocal(e *env, m *model, local netip.Addr) []string {
	var diffs []string
	var want []string
	for _, n := range m.nets {
		for _, ep := range n.eps {
			if ep.joined {
				p := peerdb.Peer{EndpointID: ep.id, IP: ep.addr.Addr(), IPv6: ep.addr6.Addr(), MAC: ep.mac}
				want = append(want, fmt.Sprintf("local vni=%d %s", n.subnets[ep.subnet].vni, fmtPeer(&p)))
			}
		}
	}
	sort.Strings(want)
	pub, bad := e.pub.lines()
	for _, b := range bad {
		diffs = append(diffs, "published: "+b)
	}
	for _, l := range diffLines(want, pub) {
		diffs = append(diffs, "published vs model: "+l)
	}
	var lp []string
	for _, r := range e.d.LocalPeers() {
		lp = append(lp, fmt.Sprintf("local vni=%d %s", r.VNI, fmtPeer(&r.Peer)))
	}
	sort.Strings(lp)
	for _, l := range diffLines(want, lp) {
		diffs = append(diffs, "LocalPeers vs model: "+l)
	}
	e.announceMu.Lock()
	announced := slices.Clone(e.announced)
	e.announceMu.Unlock()
	switch {
	case e.fixedAdv.IsValid():
		if local != e.fixedAdv {
			diffs = append(diffs, fmt.Sprintf("driver VTEP %v, configured %v", local, e.fixedAdv))
		}
	case len(announced) == 0:
		if local.IsValid() {
			diffs = append(diffs, fmt.Sprintf("driver VTEP %v before DiscoverNew announced one (no default route)", local))
		}
	case !slices.Contains(announced, local):
		diffs = append(diffs, fmt.Sprintf("driver VTEP %v was never announced (DiscoverNew Self: %v)", local, announced))
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

func (h *harness) writeTrace(evs []tev) {
	enc := json.NewEncoder(h.tw)
	for _, ev := range evs {
		enc.Encode(ev)
	}
	h.tw.Flush()
	h.gz.Flush()
}

var (
	idWord = regexp.MustCompile(`[A-Za-z0-9_.-]+`)
	// vniWord finds the VNIs an op log line names: "vni=N", or a key
	// "N/origin/endpoint".
	vniWord = regexp.MustCompile(`vni=(\d+)|\b(\d+)/(?:host|stale)-`)
)

func (h *harness) fail(res *runResult, phase int, start time.Time, diffs []string) *runResult {
	h.flushTrace()
	res.failed, res.diffs = true, diffs
	res.ops, res.elapsed, res.phases, res.stats = h.ops.Load(), time.Since(start), phase, h.m.stats
	h.finishStats(res)

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
	relevant := func(ev tev) bool {
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
	recs := h.e.src.snapshot()
	var src []string
	for _, k := range sortedKeys(recs) {
		if len(nets) == 0 || vnis[k.VNI] {
			p := recs[k]
			src = append(src, fmtKey(k)+" = "+fmtPeer(&p))
		}
	}
	fmt.Fprintf(&b, "\nthe source's records of their VNIs: %d\n", len(src))
	writeTail(&b, src, 200)
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
	for _, m := range vniWord.FindAllStringSubmatch(line, -1) {
		v, _ := strconv.ParseUint(m[1]+m[2], 10, 32)
		if vnis[uint32(v)] {
			return true
		}
	}
	return strings.Contains(line, "Audit") || strings.Contains(line, "Reconcile")
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
