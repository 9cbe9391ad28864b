package driver

import (
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// Leave hands its kernel deletions to the driver's reaper: these tests hold
// the reaper's workers (deletions then run only when someone needs them
// over) to look at the state while they are pending.

// linksAt lists the links of the namespace mounted at path (none if it is
// not mounted), by name.
func linksAt(t *testing.T, path string) map[string]netlink.Link {
	t.Helper()
	out := map[string]netlink.Link{}
	if !netnsutil.IsNamespace(path) {
		return out
	}
	ns, err := netnsutil.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		out[l.Attrs().Name] = l
	}
	return out
}

func hostHasLink(t *testing.T, host *nstest.NS, name string) bool {
	t.Helper()
	for _, n := range nstest.LinkNames(t, host.NL) {
		if n == name {
			return true
		}
	}
	return false
}

// networkWithFirst returns a driver on a fresh host whose network "n" (VNI
// 100, 198.51.100.0/24) has the joined endpoint "first", so that later
// Leaves are not the last.
func networkWithFirst(t *testing.T) (*Driver, *nstest.NS) {
	t.Helper()
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "100", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "first", "198.51.100.2/24")
	mustJoin(t, d, "n", "first")
	return d, hosts[0]
}

// leaveWithDeletionsPending builds networks "a" (endpoints a1, a2) and
// "b" (b1), all joined, holds d's reaper and makes a2 and b1 leave: a2's
// veth and b's sandbox then await deletion. It returns a2's link names.
func leaveWithDeletionsPending(t *testing.T, d *Driver) (host2, sb2 string) {
	t.Helper()
	mustCreate(t, d, createReq("a", "100", "198.51.100.0/24"))
	mustCreate(t, d, createReq("b", "101", "203.0.113.0/24"))
	mustEndpoint(t, d, "a", "a1", "198.51.100.2/24")
	mustEndpoint(t, d, "a", "a2", "198.51.100.3/24")
	mustEndpoint(t, d, "b", "b1", "203.0.113.2/24")
	for _, j := range [][2]string{{"a", "a1"}, {"a", "a2"}, {"b", "b1"}} {
		mustJoin(t, d, j[0], j[1])
	}
	host2, sb2 = endpointNames(t, d, "a", "a2")
	d.reaper.Hold()
	for _, j := range [][2]string{{"a", "a2"}, {"b", "b1"}} {
		if err := d.Leave(&api.LeaveRequest{NetworkID: j[0], EndpointID: j[1]}); err != nil {
			t.Fatal(err)
		}
	}
	return host2, sb2
}

func endpointNames(t *testing.T, d *Driver, nid, eid string) (host, sb string) {
	t.Helper()
	n, unlock, err := d.lockNetwork(nid)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	ep := n.endpoints[eid]
	return ep.hostName, ep.sbName
}

// A non-last Leave takes the veth out of service at once (off the bridge,
// down, marked for deletion) and leaves its deletion to the reaper. Audit
// sees nothing wrong while it is pending. A Join of the same endpoint (same
// link names) meanwhile deletes it first and gets a new veth, which the
// queued deletion then leaves alone; traffic flows over it.
func TestRejoinWhileVethAwaitsDeletion(t *testing.T) {
	d, host := networkWithFirst(t)
	mustEndpoint(t, d, "n", "e", "198.51.100.3/24")
	mustJoin(t, d, "n", "e")
	hostName, sbName := endpointNames(t, d, "n", "e")
	path := d.host.Path("n")
	old := linksAt(t, path)[sbName].Attrs().Index

	release := d.reaper.Hold()
	defer release()
	if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "e"}); err != nil {
		t.Fatal(err)
	}
	l, ok := linksAt(t, path)[sbName]
	if !ok || !hostHasLink(t, host, hostName) {
		t.Fatalf("veth %s/%s deleted within Leave: its deletion must be left to the reaper", sbName, hostName)
	}
	if a := l.Attrs(); a.Group != sandbox.RetiredGroup || a.MasterIndex != 0 {
		t.Fatalf("pending veth %s: group %#x, master %d; want group %#x, off the bridge", sbName, a.Group, a.MasterIndex, sandbox.RetiredGroup)
	}
	mustAudit(t, d)

	resp := mustJoin(t, d, "n", "e")
	l, ok = linksAt(t, path)[sbName]
	if !ok || l.Attrs().Index == old || l.Attrs().Group != sandbox.LinkGroup || l.Attrs().MasterIndex == 0 {
		t.Fatalf("re-Join: veth %s present %v, index %d (old %d), group %#x, master %d; want a new one on the bridge", sbName, ok, l.Attrs().Index, old, l.Attrs().Group, l.Attrs().MasterIndex)
	}
	mustAudit(t, d)
	release()
	d.WaitDeletions()
	if l2, ok := linksAt(t, path)[sbName]; !ok || l2.Attrs().Index != l.Attrs().Index {
		t.Fatalf("the queued deletion took the re-joined endpoint's veth %s", sbName)
	}
	mustAudit(t, d)
	c := nstest.Container(t, "c", host, resp.InterfaceName.SrcName, netip.MustParsePrefix("198.51.100.3/24"), nil)
	if err := nstest.PingEventually(c, netip.MustParseAddr("198.51.100.1"), 5*time.Second); err != nil {
		t.Fatalf("re-joined endpoint cannot reach its gateway: %v", err)
	}
}

// Leaves in a burst share one deletion: the veths retired while it is
// queued go with it.
func TestLeavesShareOneDeletion(t *testing.T) {
	d, _ := networkWithFirst(t)
	eps := []string{"a", "b", "c"}
	for i, e := range eps {
		mustEndpoint(t, d, "n", e, netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 51, 100, byte(10 + i)}), 24).String())
		mustJoin(t, d, "n", e)
	}
	release := d.reaper.Hold()
	defer release()
	for _, e := range eps {
		if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: e}); err != nil {
			t.Fatal(err)
		}
	}
	n, unlock, _ := d.lockNetwork("n")
	job := n.reapVeths
	unlock()
	retired := 0
	for _, l := range linksAt(t, d.host.Path("n")) {
		if l.Attrs().Group == sandbox.RetiredGroup {
			retired++
		}
	}
	if retired != 3 {
		t.Fatalf("%d veths await deletion, want 3", retired)
	}
	mustAudit(t, d)
	if err := job.Finish(); err != nil {
		t.Fatal(err)
	}
	for name, l := range linksAt(t, d.host.Path("n")) {
		if l.Attrs().Group == sandbox.RetiredGroup {
			t.Errorf("veth %s still awaits deletion after the one queued deletion ran", name)
		}
	}
	mustAudit(t, d)
}

// The last Leave hands the whole sandbox to the reaper. Audit sees nothing
// wrong while its teardown is pending; a Join of the network meanwhile
// finishes the teardown first and builds a new sandbox (same path, same
// VNI); a DeleteNetwork meanwhile finishes it before answering, and a new
// network with the same VNI can be created and joined at once.
func TestLastLeaveTeardownPending(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "100", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "e1", "198.51.100.2/24")
	mustJoin(t, d, "n", "e1")
	path := d.host.Path("n")
	release := d.reaper.Hold()
	defer release()

	if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "e1"}); err != nil {
		t.Fatal(err)
	}
	if !isNS(path) || len(linksAt(t, path)) < 3 {
		t.Fatalf("sandbox %s torn down within the last Leave: its teardown must be left to the reaper", path)
	}
	mustAudit(t, d)
	if st := d.Status(); st.Networks[0].Error != "" {
		t.Fatalf("status while the teardown is pending: %q", st.Networks[0].Error)
	}

	mustEndpoint(t, d, "n", "e2", "198.51.100.3/24")
	mustJoin(t, d, "n", "e2")
	mustAudit(t, d)
	if _, ok := linksAt(t, path)[sandbox.VXLANName(100)]; !ok {
		t.Fatalf("no VXLAN in the new sandbox: %v", linksAt(t, path))
	}

	if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "e2"}); err != nil {
		t.Fatal(err)
	}
	if !isNS(path) {
		t.Fatal("the second last Leave tore the sandbox down itself")
	}
	if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "n"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("sandbox %s still there after DeleteNetwork answered (%v)", path, err)
	}
	mustAudit(t, d)
	mustCreate(t, d, createReq("m", "100", "198.51.100.0/24"))
	mustEndpoint(t, d, "m", "e3", "198.51.100.4/24")
	mustJoin(t, d, "m", "e3")
	mustAudit(t, d)
}

// Close (a stopping daemon) finishes the deletions Leaves handed over.
func TestCloseFinishesPendingDeletions(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d, err := New(alone(Config{HostNS: hosts[0].Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: vteps[0], Logger: testLogger(), Peers: newMemSource()}))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			d.Close()
		}
	})
	host2, sb2 := leaveWithDeletionsPending(t, d)
	if _, ok := linksAt(t, d.host.Path("a"))[sb2]; !ok || !isNS(d.host.Path("b")) {
		t.Fatal("the Leaves deleted their veth and sandbox themselves: nothing was left pending for Close")
	}
	d.Close()
	closed = true
	if _, ok := linksAt(t, d.host.Path("a"))[sb2]; ok || hostHasLink(t, hosts[0], host2) {
		t.Errorf("veth %s/%s of a Leave still there after Close", sb2, host2)
	}
	if _, err := os.Lstat(d.host.Path("b")); !os.IsNotExist(err) {
		t.Errorf("sandbox of b's last Leave still there after Close (%v)", err)
	}
	if !isNS(d.host.Path("a")) {
		t.Error("Close removed the sandbox of a, which has a joined endpoint")
	}
}

// A daemon that dies with deletions pending leaves them in the kernel: a
// retired veth in a sandbox that is still in use, and the sandbox of a last
// Leave. The next start removes the sandbox (its network has no joined
// endpoint) and deletes the veth; a veth left awaiting deletion with none
// queued (a deletion that failed) is reported by Audit and deleted through
// the periodic reconcile.
func TestRestartWithPendingDeletions(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	host := hosts[0]
	stateDir, netnsDir := t.TempDir(), nstest.NetnsDir(t)
	st := openStore(t, stateDir)
	cfg := Config{HostNS: host.Handle, NetnsDir: netnsDir, AdvertiseAddr: vteps[0], Logger: testLogger(), StateFile: st, Peers: newMemSource()}
	d, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	host2, sb2 := leaveWithDeletionsPending(t, d)
	// The crash: nothing queued runs.
	d.reaper.Abandon()
	d.Close()
	st.Close()
	if l, ok := linksAt(t, d.host.Path("a"))[sb2]; !ok || l.Attrs().Group != sandbox.RetiredGroup || !isNS(d.host.Path("b")) {
		t.Fatal("the crash did not leave the pending deletions in the kernel")
	}

	st = openStore(t, stateDir)
	defer st.Close()
	cfg.StateFile = st
	d, err = New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := os.Lstat(d.host.Path("b")); !os.IsNotExist(err) {
		t.Errorf("the sandbox of b's last Leave is still there after the restart (%v)", err)
	}
	d.WaitDeletions()
	if _, ok := linksAt(t, d.host.Path("a"))[sb2]; ok || hostHasLink(t, host, host2) {
		t.Errorf("retired veth %s/%s still there after the restart's deletions", sb2, host2)
	}
	mustAudit(t, d)

	// A veth left awaiting deletion with none queued.
	h := sandboxHandle(t, d, "a")
	left := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "ovsleft", Group: sandbox.RetiredGroup}, PeerName: "ovdleft", PeerNamespace: netlink.NsFd(int(host.Handle))}
	if err := h.LinkAdd(left); err != nil {
		t.Fatal(err)
	}
	problems, err := d.Audit()
	if err != nil || len(problems) != 1 || !strings.Contains(problems[0], "ovsleft: awaits deletion, but none is queued") {
		t.Fatalf("Audit with a veth awaiting deletion and none queued: %v %v", problems, err)
	}
	fixed, err := d.Reconcile()
	if err != nil || len(fixed) != 1 || !strings.Contains(fixed[0], "deletion queued") {
		t.Fatalf("Reconcile: fixed %v, err %v; want the deletion queued", fixed, err)
	}
	d.WaitDeletions()
	if _, ok := linksAt(t, d.host.Path("a"))["ovsleft"]; ok || hostHasLink(t, host, "ovdleft") {
		t.Fatal("the reconcile's deletion left the veth")
	}
	mustAudit(t, d)
}
