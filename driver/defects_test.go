package driver

import (
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/testutil/logrec"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/solo"
	"github.com/overlayd/overlayd/peerdb"
)

// Deterministic tests of defects the redesign removed: each failed on the
// driver before it.

// CreateNetwork while a DeleteNetwork of the same id (and VNI) is in flight
// waits for it and then succeeds, instead of failing with "already
// exists". The test holds the network's lock as the in-flight delete does.
func TestCreateWaitsForInFlightDelete(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq("n", "40", "198.51.100.0/24"))
	n, unlock, err := d.lockNetwork("n")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- d.CreateNetwork(createReq("n", "40", "198.51.100.0/24")) }()
	// Wait until the create is blocked on the network's lock (or returned).
	if err := nstest.Eventually(10*time.Second, time.Millisecond, func() error {
		select {
		case err := <-done:
			unlock()
			t.Fatalf("CreateNetwork did not wait for the delete in flight: %v", err)
		default:
		}
		if !blockedIn("driver.(*Driver).register") {
			return errors.New("not blocked yet")
		}
		return nil
	}); err != nil {
		unlock()
		t.Fatal(err)
	}
	// Finish the delete as DeleteNetwork does, then release the lock.
	d.unregisterLocked(n)
	unlock()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("CreateNetwork after the delete finished: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("CreateNetwork still blocked after the delete finished")
	}
	if st := d.Status(); len(st.Networks) != 1 || st.Networks[0].ID != "n" {
		t.Fatalf("networks after create-after-delete: %+v", st.Networks)
	}
	// A network that stays is still refused, naming it.
	if err := d.CreateNetwork(createReq("n", "41", "203.0.113.0/24")); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("duplicate id: %v", err)
	}
	if err := d.CreateNetwork(createReq("m", "40", "203.0.113.0/24")); err == nil || !strings.Contains(err.Error(), `already used by network "n"`) {
		t.Fatalf("duplicate VNI: %v", err)
	}
}

// Concurrent create/delete of one id from many goroutines: every create
// either succeeds or says the id exists; at the end the driver and the
// kernel agree.
func TestCreateDeleteRace(t *testing.T) {
	d := newOfflineDriver(t)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				if err := d.CreateNetwork(createReq("x", "50", "198.51.100.0/24")); err != nil && !strings.Contains(err.Error(), "already exists") {
					t.Errorf("create: %v", err)
				}
				if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "x"}); err != nil {
					t.Errorf("delete: %v", err)
				}
			}
		}()
	}
	wg.Wait()
	mustAudit(t, d)
}

// A last Leave whose sandbox removal fails keeps the sandbox referenced and
// reports it; the periodic reconcile finishes the removal once it can.
// (Before, Leave dropped the reference and the namespace leaked for good.)
// The removal is the reaper's, off the Leave's path: Leave succeeds, the
// failure shows in the log and the status once the reaper tried.
func TestLeaveKeepsSandboxWhenDestroyFails(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	rec := &logrec.Recorder{}
	d := newTestDriverLogging(t, hosts[0], vteps[0], rec.Logger())
	mustCreate(t, d, createReq("n", "42", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "e", "198.51.100.5/24")
	mustJoin(t, d, "n", "e")
	// Make the sandbox directory immutable: its mount point cannot be
	// removed (the unmount still works).
	dir := d.cfg.NetnsDir
	setImmutable(t, dir, true)
	immutable := true
	t.Cleanup(func() {
		if immutable {
			setImmutable(t, dir, false)
		}
	})
	if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "e"}); err != nil {
		t.Fatalf("Leave: %v (removing the sandbox is the reaper's job, not the Leave's)", err)
	}
	d.WaitDeletions()
	if st := d.Status(); len(st.Networks) != 1 || !strings.Contains(st.Networks[0].Error, "could not be removed") {
		t.Fatalf("status does not report the sandbox left behind: %+v", st.Networks)
	}
	if problems, err := d.Audit(); err != nil || len(problems) != 1 || !strings.Contains(problems[0], "no network of this host has a sandbox") {
		t.Fatalf("Audit after the failed removal: %v %v; want the mount point left behind", problems, err)
	}
	// Writable again: the reconcile removes it.
	setImmutable(t, dir, false)
	immutable = false
	fixed, err := d.Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	if len(fixed) != 1 || !strings.Contains(fixed[0], "removed the sandbox") {
		t.Fatalf("reconcile fixed %v", fixed)
	}
	rec.One(t, slog.LevelInfo, logkeys.ReconcileRepair, []string{logkeys.Kind, logkeys.KindSandbox, logkeys.Network, "n", logkeys.Count, "1"}, logkeys.First)
	mustAudit(t, d)
	if st := d.Status(); st.Networks[0].Error != "" || st.Networks[0].Sandbox != "" {
		t.Fatalf("status after the removal: %+v", st.Networks[0])
	}
}

// An update whose previous record was refused still takes its valid new
// record (before, an event with an invalid Prev was rejected whole and the
// valid Next dropped).
func TestUpdateAfterRefusedRecordIsTaken(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "43", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "local", "198.51.100.2/24")
	mustJoin(t, d, "n", "local")
	vtep := netip.MustParseAddr("192.0.2.50")
	bad := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.9"), VTEP: vtep} // no MAC
	if err := applyPeerEvent(d, PeerEvent{VNI: 43, Next: &bad}); err == nil {
		t.Fatal("a record without MAC was taken")
	}
	good := bad
	good.MAC = peerdb.MAC{2, 0, 0, 0, 0, 9}
	if err := applyPeerEvent(d, PeerEvent{VNI: 43, Prev: &bad, Next: &good}); err != nil {
		t.Fatal(err)
	}
	wantPeers(t, d, "n", map[string]string{"198.51.100.9": "02:00:00:00:00:09"}, map[string]string{"02:00:00:00:00:09": "192.0.2.50"})
	if st := d.Status(); len(st.Networks[0].Rejected) != 0 {
		t.Fatalf("still listed as refused: %+v", st.Networks[0].Rejected)
	}
}

// A record that does not fit a network stays with its owner and is taken
// when a network it fits is created (before, it was dropped for good).
func TestMisfitRecordTakenByLaterNetwork(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	p := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("203.0.113.9"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: netip.MustParseAddr("192.0.2.51")}
	if err := applyPeerEvent(d, PeerEvent{VNI: 44, Next: &p}); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, d, createReq("n", "44", "198.51.100.0/24")) // does not fit
	if st := d.Status(); len(st.Networks[0].Rejected) != 1 || !strings.Contains(st.Networks[0].Rejected[0].Reason, "203.0.113.9") {
		t.Fatalf("misfit record not reported: %+v", st.Networks[0])
	}
	if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "n"}); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, d, createReq("n", "44", "203.0.113.0/24")) // fits
	mustEndpoint(t, d, "n", "local", "203.0.113.2/24")
	mustJoin(t, d, "n", "local")
	wantPeers(t, d, "n", map[string]string{"203.0.113.9": "02:00:00:00:00:09"}, map[string]string{"02:00:00:00:00:09": "192.0.2.51"})
}

// A change the network was never told of (a lost notification) is
// repaired by the periodic reconcile, which compares the source with the
// peer table, not the control plane's own bookkeeping.
func TestReconcilePullsMissedChanges(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "45", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "local", "198.51.100.2/24")
	mustJoin(t, d, "n", "local")
	a := peerdb.Peer{EndpointID: "a", IP: netip.MustParseAddr("198.51.100.10"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 10}, VTEP: netip.MustParseAddr("192.0.2.52")}
	b := peerdb.Peer{EndpointID: "b", IP: netip.MustParseAddr("198.51.100.11"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 11}, VTEP: netip.MustParseAddr("192.0.2.52")}
	if err := applyPeerEvent(d, PeerEvent{VNI: 45, Next: &a}); err != nil {
		t.Fatal(err)
	}
	// The source changes without telling the driver: a gone, b new.
	source(d).apply([]PeerEvent{{VNI: 45, Prev: &a}, {VNI: 45, Next: &b}})
	wantPeers(t, d, "n", map[string]string{"198.51.100.10": "02:00:00:00:00:0a"}, map[string]string{"02:00:00:00:00:0a": "192.0.2.52"})
	fixed, err := d.Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	_ = fixed // the pull's own delta is programmed by pull; the dump-diff then finds nothing
	wantPeers(t, d, "n", map[string]string{"198.51.100.11": "02:00:00:00:00:0b"}, map[string]string{"02:00:00:00:00:0b": "192.0.2.52"})
	mustAudit(t, d)
}

// recordingPublisher keeps what the driver publishes: the records, and
// the VTEPs in the order they were told.
type recordingPublisher struct {
	solo.ControlPlane
	mu    sync.Mutex
	last  map[string]peerdb.Peer // by endpoint id
	vteps []netip.Addr
}

func (r *recordingPublisher) VTEPChanged(a netip.Addr) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.vteps = append(r.vteps, a)
}

func (r *recordingPublisher) PublishLocalPeer(vni uint32, prev, next *peerdb.Peer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.last == nil {
		r.last = map[string]peerdb.Peer{}
	}
	if next != nil {
		r.last[next.EndpointID] = *next
	} else if prev != nil {
		delete(r.last, prev.EndpointID)
	}
}

// Endpoints restored after a restart with another advertise address are
// announced with the new VTEP (before, they kept the VTEP saved in the state
// file and the control plane refused them for good). End to end, with the
// control plane: test/multihost.
func TestRestartWithNewAddressAnnouncesNewVTEP(t *testing.T) {
	host := nstest.NewNS(t, "host")
	st := openStore(t, t.TempDir())
	defer st.Close()
	netnsDir := nstest.NetnsDir(t)
	cfg := Config{HostNS: host.Handle, NetnsDir: netnsDir, Logger: testLogger(), StateFile: st, Peers: newMemSource(),
		AdvertiseAddr: netip.MustParseAddr("192.0.2.60")}
	d1, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	mustCreate(t, d1, createReq("n", "46", "198.51.100.0/24"))
	mustEndpoint(t, d1, "n", "e", "198.51.100.5/24")
	mustJoin(t, d1, "n", "e")
	d1.Close()
	cfg.AdvertiseAddr = netip.MustParseAddr("192.0.2.61")
	d2, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	// The restored endpoint's record carries no VTEP of its own (the
	// control plane stamps the one it advertises, which follows the
	// driver's); the driver's is the new one.
	got := d2.LocalPeers()
	if len(got) != 1 || got[0].Peer.VTEP.IsValid() || got[0].VNI != 46 {
		t.Fatalf("restored endpoint announced as %+v, want no VTEP of its own", got)
	}
	if v := d2.VTEP(); v != cfg.AdvertiseAddr {
		t.Fatalf("VTEP %v, want %v", v, cfg.AdvertiseAddr)
	}
}

// In swarm (scope global) without a configured address the VTEP is the one
// swarm announces, never the default route's first (before, the driver
// started on the default route's address and moved later, and every local
// record was refused from then on). A later announcement of another
// address changes it and is notified, in order, and Joins publish with it.
func TestVTEPOwner(t *testing.T) {
	hosts, _ := nstest.Hosts(t, 1, false) // has a default route with an address
	pub := &recordingPublisher{}
	d, err := New(alone(Config{Scope: api.GlobalScope, HostNS: hosts[0].Handle, NetnsDir: nstest.NetnsDir(t), Logger: testLogger(),
		Peers: newMemSource(), Publisher: pub}))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if v := d.VTEP(); v.IsValid() {
		t.Fatalf("swarm-scoped driver took %v before swarm announced this node", v)
	}
	self := func(addr string) {
		t.Helper()
		if err := d.DiscoverNew(&api.DiscoveryNotification{DiscoveryType: 1, DiscoveryData: map[string]interface{}{"Address": addr, "Self": true}}); err != nil {
			t.Fatal(err)
		}
	}
	self("192.0.2.70")
	self("192.0.2.70") // repeated: no change
	mustCreate(t, d, createReq("n", "47", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "e", "198.51.100.5/24")
	mustJoin(t, d, "n", "e")
	self("192.0.2.71")
	pub.mu.Lock()
	got := append([]netip.Addr(nil), pub.vteps...)
	pub.mu.Unlock()
	want := []netip.Addr{netip.MustParseAddr("192.0.2.70"), netip.MustParseAddr("192.0.2.71")}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("VTEP changes notified: %v, want %v", got, want)
	}
	if v := d.VTEP(); v != want[1] {
		t.Fatalf("VTEP %v, want %v", v, want[1])
	}
	// Published without a VTEP: the control plane stamps its own, told by
	// LocalPublisher.VTEPChanged, so no copy of the VTEP can go stale.
	if p, ok := pub.last["e"]; !ok || p.VTEP.IsValid() {
		t.Fatalf("Join published %v (present %v), want a record without VTEP", p, ok)
	}
	// A configured address is never overridden.
	d2, err := New(alone(Config{Scope: api.GlobalScope, HostNS: hosts[0].Handle, NetnsDir: nstest.NetnsDir(t), Logger: testLogger(),
		AdvertiseAddr: netip.MustParseAddr("192.0.2.80")}))
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if err := d2.DiscoverNew(&api.DiscoveryNotification{DiscoveryType: 1, DiscoveryData: map[string]interface{}{"Address": "192.0.2.81", "Self": true}}); err != nil {
		t.Fatal(err)
	}
	if v := d2.VTEP(); v != netip.MustParseAddr("192.0.2.80") {
		t.Fatalf("configured VTEP overridden by DiscoverNew: %v", v)
	}
}

// blockedIn reports whether some goroutine is blocked on a mutex inside fn.
func blockedIn(fn string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "[sync.Mutex.Lock") && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}

// setImmutable sets or clears the immutable attribute of dir (chattr +i):
// nothing in it can be removed while it is set.
func setImmutable(t *testing.T, dir string, on bool) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	flags, err := unix.IoctlGetUint32(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		t.Skipf("the file system of %s has no file attributes: %v", dir, err)
	}
	const immutableFl = 0x10 // FS_IMMUTABLE_FL
	if on {
		flags |= immutableFl
	} else {
		flags &^= immutableFl
	}
	v := int(flags)
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.FS_IOC_SETFLAGS, v); err != nil {
		t.Fatalf("setting the immutable attribute of %s: %v", dir, err)
	}
}
