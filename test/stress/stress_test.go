package stress

import (
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/peerdb"
)

// Defaults of the CI run: at least 20,000 operations from 32 goroutines,
// with a quiet point every 20 operations per worker (640 operations).
const (
	ciOps      = 20480
	ciWorkers  = 32
	ciPhaseOps = 20
)

// stressConfig reads the run's settings from the environment:
//
//	OVERLAYD_SEED=<n>          replay a seed (default: a new one, printed)
//	OVERLAYD_SOAK=<d or n>     soak for a duration ("10m") or an operation count
//	OVERLAYD_WORKERS=<n>       goroutines (default 32)
//	OVERLAYD_STRESS_OPS=<n>    operations of the bounded run (default 20480)
func stressConfig(t *testing.T) runConfig {
	cfg := runConfig{workers: ciWorkers, ops: ciOps, phaseOps: ciPhaseOps, teardown: true}
	if testing.Short() {
		cfg.ops = 4096
	}
	cfg.seed = time.Now().UnixNano() % 1_000_000_000
	if s := os.Getenv("OVERLAYD_SEED"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("OVERLAYD_SEED=%q: not an integer", s)
		}
		cfg.seed = n
	}
	if s := os.Getenv("OVERLAYD_WORKERS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("OVERLAYD_WORKERS=%q: want a positive integer", s)
		}
		cfg.workers = n
	}
	if s := os.Getenv("OVERLAYD_STRESS_OPS"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 1 {
			t.Fatalf("OVERLAYD_STRESS_OPS=%q: want a positive integer", s)
		}
		cfg.ops = n
	}
	if s := os.Getenv("OVERLAYD_SOAK"); s != "" {
		if n, err := strconv.ParseInt(s, 10, 64); err == nil && n > 0 {
			cfg.ops = n
		} else if d, err := time.ParseDuration(s); err == nil && d > 0 {
			cfg.ops, cfg.duration = 0, d
		} else {
			t.Fatalf("OVERLAYD_SOAK=%q: want a duration (10m) or an operation count (1000000)", s)
		}
	}
	// Half the seeds configure the advertise address, the others learn it
	// from DiscoverNew while the workload runs.
	cfg.fixedAdv = cfg.seed%2 == 0
	return cfg
}

// TestStress is the bounded CI run (a soak with OVERLAYD_SOAK): 0
// divergences between kernel, model and driver, 0 impossible outcomes, 0
// deadlocks, 0 lock-order inversions.
func TestStress(t *testing.T) {
	cfg := stressConfig(t)
	t.Logf("seed %d, %d workers, %s (replay: OVERLAYD_SEED=%d)", cfg.seed, cfg.workers, budget(cfg), cfg.seed)
	res := runStress(t, cfg)
	if res.failed {
		t.Fatal(res.report)
	}
	t.Logf("%d operations in %v (%.0f ops/s), %d quiet points, all clean; lock order checked: %v",
		res.ops, res.elapsed.Round(time.Millisecond), float64(res.ops)/res.elapsed.Seconds(), res.phases, lockorder.Enabled)
	t.Logf("model: %s", res.stats)
	t.Logf("keys: %s", res.keys)
	logInferred(t, res)
	// The run must have exercised what it claims to.
	if res.ops >= ciOps {
		s := res.stats
		for _, c := range []struct {
			what      string
			got, want int
		}{
			{"network creations", s.creates, 50}, {"network deletions", s.deletes, 20},
			{"joins", s.joins, 200}, {"sandboxes built", s.sandboxesBuilt, 30}, {"leaves", s.leaves, 100},
			{"peer events on networks with a sandbox", s.peerOnSandbox, 1000},
			{"pending peer events", s.pendingEvents, 200}, {"early peers applied", s.earlyApplied, 50},
			{"early peers dropped", s.earlyDropped, 5},
		} {
			if c.got < c.want {
				t.Errorf("the workload exercised too few %s: %d, want at least %d", c.what, c.got, c.want)
			}
		}
	}
}

// TestNetworkChurn concentrates on what only the registry orders: the same
// network ids created and deleted from many goroutines while peer events for
// their VNIs arrive (applied, kept pending, handed back at delete, drained
// at create), with a few endpoints so some deletions tear sandboxes down.
func TestNetworkChurn(t *testing.T) {
	cfg := stressConfig(t)
	cfg.ops = 10240
	if testing.Short() {
		cfg.ops = 2048
	}
	cfg.mix = &opMix{peer: 50, netCreate: 20, netDelete: 15, epCreate: 8, join: 5, leave: 1, info: 1}
	t.Logf("seed %d, %d workers, %s (replay: OVERLAYD_SEED=%d)", cfg.seed, cfg.workers, budget(cfg), cfg.seed)
	res := runStress(t, cfg)
	if res.failed {
		t.Fatal(res.report)
	}
	t.Logf("%d operations in %v (%.0f ops/s), %d quiet points, all clean", res.ops, res.elapsed.Round(time.Millisecond), float64(res.ops)/res.elapsed.Seconds(), res.phases)
	t.Logf("model: %s", res.stats)
	logInferred(t, res)
}

// logInferred reports where the driver traced a DeleteNetwork after events
// that depend on it (see model.inferDelete): harmless to the model, but the
// trace is not in linearisation order there.
func logInferred(t *testing.T, res *runResult) {
	if len(res.inferred) == 0 {
		return
	}
	t.Logf("trace out of linearisation order %d time(s) (DeleteNetwork traced after events that depend on it; the model infers the deletion and requires its trace to arrive before the quiet point):\n  %s",
		res.stats.inferredDeletes, strings.Join(res.inferred, "\n  "))
}

func budget(cfg runConfig) string {
	if cfg.ops > 0 {
		return strconv.FormatInt(cfg.ops, 10) + " operations"
	}
	return cfg.duration.String()
}

// The watchdog reports an operation blocked past its limit, with stacks.
func TestWatchdogFires(t *testing.T) {
	w := newWatchdog(200*time.Millisecond, 2)
	defer w.close()
	w.begin(1, "a blocked operation")
	select {
	case <-w.fired:
	case <-time.After(5 * time.Second):
		t.Fatal("watchdog did not fire")
	}
	if !strings.Contains(w.msg, "a blocked operation") || !strings.Contains(w.msg, "goroutine ") {
		t.Fatalf("watchdog report lacks the operation or the stacks:\n%s", w.msg)
	}
}

// A driver operation that never returns (here: a Join whose trace callback
// blocks while the driver holds the network's lock, so every other operation
// on that network waits too) fails the run through the watchdog, with the
// blocked operations and all stacks; the environment is still cleaned up.
func TestWatchdogCatchesBlockedDriver(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	cfg := runConfig{seed: 7, workers: 8, ops: 100000, phaseOps: 1000, watchdog: time.Second, fixedAdv: true,
		traceHook: func(ev driver.TraceEvent) {
			if ev.Kind == driver.TraceJoin {
				blocked := false
				once.Do(func() { blocked = true })
				if blocked {
					<-release
				}
			}
		}}
	res := runStress(t, cfg)
	// Runs before runStress's cleanups, which wait for the released workers
	// to finish before the driver is closed.
	t.Cleanup(func() { close(release) })
	if !res.failed || !res.deadlock {
		t.Fatalf("blocked driver not reported as a deadlock: %+v", res)
	}
	for _, want := range []string{"DEADLOCK", "Join ", "goroutine ", "OVERLAYD_SEED=7"} {
		if !strings.Contains(res.report, want) {
			t.Fatalf("deadlock report lacks %q:\n%s", want, head(res.report, 40))
		}
	}
	os.Remove(res.traceFile)
	t.Logf("%s", head(res.report, 12))
}

// With the lockcheck tag the harness's violation handler is live: an
// inversion is counted, not missed and not a panic.
func TestLockOrderHandlerActive(t *testing.T) {
	if !lockorder.Enabled {
		t.Skip("built without -tags lockcheck")
	}
	c := installLockCheck(t) // proves one deliberate inversion is counted
	a := lockorder.New(lockorder.LevelNetwork)
	b := lockorder.New(lockorder.LevelNetwork)
	a.Lock()
	b.Lock() // two network locks at once
	b.Unlock()
	a.Unlock()
	if c.n.Load() != 1 {
		t.Fatalf("inversion counted %d times, want 1", c.n.Load())
	}
}

// The model's conflict rules on hand-made cases (the kernel-facing suite
// checks them against the driver).
func TestModelRules(t *testing.T) {
	m := newModel(netip.Addr{})
	vtep := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	ip := netip.MustParseAddr("198.51.100.5")
	mac := peerdb.MACFromIP(ip)
	apply := func(ev driver.TraceEvent) {
		t.Helper()
		if err := m.apply(ev); err != nil {
			t.Fatal(err)
		}
	}
	// A peer arrives before its network, with one that does not fit.
	early := peerdb.Peer{EndpointID: "r1", IP: ip, MAC: mac, VTEP: vtep("192.0.2.51")}
	misfit := peerdb.Peer{EndpointID: "r9", IP: netip.MustParseAddr("203.0.113.9"), MAC: mac, VTEP: vtep("192.0.2.51")}
	apply(driver.TraceEvent{Kind: driver.TracePending, VNI: 7, Events: []peerdb.Event{{Next: &early}, {Next: &misfit}}})
	apply(driver.TraceEvent{Kind: driver.TraceCreateNetwork, Network: "n", VNIs: []uint32{7}, Pools: []netip.Prefix{pfx("198.51.100.0/24")}, Gateways: []netip.Prefix{{}}, MTU: 1450})
	if m.stats.earlyApplied != 1 || m.stats.earlyDropped != 1 || len(m.pending) != 0 {
		t.Fatalf("early peers: %+v, pending %v", m.stats, m.pending)
	}
	apply(driver.TraceEvent{Kind: driver.TraceCreateEndpoint, Network: "n", Endpoint: "e", Addr: pfx("198.51.100.9/24"), MAC: peerdb.MAC{2, 0xbb, 0, 0, 0, 1}})
	apply(driver.TraceEvent{Kind: driver.TraceJoin, Network: "n", Endpoint: "e", Addr: pfx("198.51.100.9/24"), MAC: peerdb.MAC{2, 0xbb, 0, 0, 0, 1}})
	// A smaller EndpointID wins; a second IP with the same MAC and a smaller
	// address decides the FDB; a remote with the local endpoint's MAC gets
	// no FDB entry; a remote claiming the local IP is shadowed.
	smaller := peerdb.Peer{EndpointID: "r0", IP: ip, MAC: mac, VTEP: vtep("192.0.2.53")}
	other := peerdb.Peer{EndpointID: "r2", IP: netip.MustParseAddr("198.51.100.4"), MAC: mac, VTEP: vtep("192.0.2.52")}
	localMAC := peerdb.Peer{EndpointID: "r3", IP: netip.MustParseAddr("198.51.100.7"), MAC: peerdb.MAC{2, 0xbb, 0, 0, 0, 1}, VTEP: vtep("192.0.2.50")}
	shadowed := peerdb.Peer{EndpointID: "r4", IP: netip.MustParseAddr("198.51.100.9"), MAC: peerdb.MAC{2, 0xbb, 0, 0, 0, 2}, VTEP: vtep("192.0.2.50")}
	apply(driver.TraceEvent{Kind: driver.TracePeerEvents, Network: "n", VNI: 7, Events: []peerdb.Event{{Next: &smaller}, {Next: &other}, {Next: &localMAC}, {Next: &shadowed}}})
	got := strings.Join(m.nets["n"].desiredPeers(), "\n")
	for _, want := range []string{
		"n neigh ovvx-7 198.51.100.5 lladdr 02:42:c6:33:64:05 permanent",
		"n neigh ovvx-7 198.51.100.4 lladdr 02:42:c6:33:64:05 permanent",
		"n neigh ovvx-7 198.51.100.7 lladdr 02:bb:00:00:00:01 permanent",
		"n fdb ovvx-7 02:42:c6:33:64:05 dst 192.0.2.52 self permanent",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in\n%s", want, got)
		}
	}
	if strings.Contains(got, "198.51.100.9") || strings.Contains(got, "02:bb:00:00:00:01 dst") || len(strings.Split(got, "\n")) != 4 {
		t.Errorf("unexpected entries in\n%s", got)
	}
	// Delete returns the remote peers to pending under their subnet's VNI.
	apply(driver.TraceEvent{Kind: driver.TraceDeleteNetwork, Network: "n"})
	if len(m.pending[7]) != 5 {
		t.Fatalf("pending after delete: %v", m.pending)
	}
	// An event that is only possible after a delete not yet traced: the
	// model infers it and owes the trace event.
	apply(driver.TraceEvent{Kind: driver.TraceCreateNetwork, Network: "n", VNIs: []uint32{7}, Pools: []netip.Prefix{pfx("198.51.100.0/24")}, Gateways: []netip.Prefix{{}}, MTU: 1450})
	apply(driver.TraceEvent{Kind: driver.TracePending, VNI: 7})
	if err := m.settled(); err == nil {
		t.Fatal("an inferred delete without its trace event went unnoticed")
	}
	apply(driver.TraceEvent{Kind: driver.TraceDeleteNetwork, Network: "n"})
	if err := m.settled(); err != nil {
		t.Fatal(err)
	}
	if err := m.apply(driver.TraceEvent{Kind: driver.TraceJoin, Network: "n", Endpoint: "e"}); err == nil {
		t.Fatal("a Join on a deleted network was accepted")
	}
}

func head(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = append(lines[:n], "  ...")
	}
	return strings.Join(lines, "\n")
}
