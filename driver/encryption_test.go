package driver

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/testutil/keyhub"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef")

// newOwner returns a started encryption owner for host (check replaces the
// kernel check when set), closed at the end of the test.
func newOwner(t *testing.T, host *nstest.NS, adv netip.Addr, check func() error) *encryption.Owner {
	t.Helper()
	o, err := encryption.NewOwner(encryption.OwnerConfig{NS: host.Handle, Port: DefaultVXLANPort, Secret: testSecret,
		Logger: testLogger(), CheckKernel: check})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(o.Close)
	if err := o.SetLocal(adv); err != nil && !errors.Is(err, encryption.ErrKernelUnsupported) {
		t.Fatal(err)
	}
	o.Start()
	return o
}

// encDriver returns a driver with an encryption owner; with hub, the owner
// gossips its keys through it (a lone host bootstraps epoch 1).
func encDriver(t *testing.T, host *nstest.NS, adv netip.Addr, check func() error, hub *keyhub.Hub) (*Driver, *encryption.Owner) {
	t.Helper()
	o := newOwner(t, host, adv, check)
	d, err := New(alone(Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: adv, Logger: testLogger(), Peers: newMemSource(),
		Encryption: o}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if hub != nil {
		hub.Attach(adv, o)
	}
	return d, o
}

// waitKeys waits until o sends with an epoch (its keys are established).
func waitKeys(t *testing.T, o *encryption.Owner) {
	t.Helper()
	if err := nstest.Eventually(10*time.Second, 5*time.Millisecond, func() error {
		if st := o.Status(); st.Send == 0 {
			return fmt.Errorf("no send epoch yet: %+v", st)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// policyTo reports whether ns holds an outbound xfrm policy with an ESP
// template to remote.
func policyTo(t *testing.T, ns *nstest.NS, remote netip.Addr) bool {
	t.Helper()
	for _, p := range xfrmPolicies(t, ns) {
		if p.Dir == netlink.XFRM_DIR_OUT && len(p.Tmpls) > 0 && p.Dst != nil && p.Dst.IP.Equal(remote.AsSlice()) {
			return true
		}
	}
	return false
}

func encReq(id, vni, pool string) *api.CreateNetworkRequest {
	r := createReq(id, vni, pool)
	r.Options[OptGeneric].(map[string]interface{})[OptEncrypted] = ""
	return r
}

func nftTables(t *testing.T, ns *nstest.NS) []string {
	t.Helper()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	if err != nil {
		t.Fatal(err)
	}
	tabs, err := c.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tab := range tabs {
		names = append(names, tab.Name)
	}
	return names
}

func xfrmPolicies(t *testing.T, ns *nstest.NS) []netlink.XfrmPolicy {
	t.Helper()
	h, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_XFRM)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	pols, err := h.XfrmPolicyList(unix.AF_UNSPEC)
	if err != nil {
		t.Fatal(err)
	}
	return pols
}

// On a kernel without ESP (this machine's), an encrypted network is refused
// with an error that says why, and nothing is left behind.
func TestEncryptedNetworkRefusedWithoutESP(t *testing.T) {
	if encryption.CheckKernelSupport() == nil {
		t.Skip("this kernel can encrypt: TestEncryptedNetworkRealPath covers it")
	}
	hosts, vteps := nstest.Hosts(t, 1, false)
	d, _ := encDriver(t, hosts[0], vteps[0], nil, nil)
	err := d.CreateNetwork(encReq("enc", "700", "198.51.100.0/24"))
	if err == nil || !strings.Contains(err.Error(), "encrypted") || !strings.Contains(err.Error(), "cannot") ||
		!errors.Is(err, encryption.ErrKernelUnsupported) {
		t.Fatalf("encrypted network on a kernel without ESP: %v", err)
	}
	if st := d.Status(); len(st.Networks) != 0 {
		t.Fatalf("refused network registered: %+v", st.Networks)
	}
	if tabs := nftTables(t, hosts[0]); len(tabs) != 0 {
		t.Fatalf("nft tables left: %v", tabs)
	}
}

// With the kernel check passed by a stand-in (this kernel has xfrm policies
// and nftables but no ESP states, so only the real check can tell), the
// driver's encrypted network gets the fail-closed rules and, once keys are
// established, a policy to its remote peer's host; the missing SAs are
// reported instead of sending in clear; everything goes with the network.
// The real ESP path runs in the VM (TestEncryptedNetworkRealPath).
func TestEncryptedNetworkFailsClosedWithoutSAs(t *testing.T) {
	if encryption.CheckKernelSupport() == nil {
		t.Skip("this kernel can encrypt: TestEncryptedNetworkRealPath covers it")
	}
	hosts, vteps := nstest.Hosts(t, 1, false)
	d, o := encDriver(t, hosts[0], vteps[0], func() error { return nil }, keyhub.New())
	mustCreate(t, d, encReq("enc", "700", "198.51.100.0/24"))
	if st := d.Status(); st.Networks[0].MTU != 1416 || !st.Networks[0].Encrypted {
		t.Fatalf("encrypted network status: %+v (want MTU 1416)", st.Networks[0])
	}
	if tabs := nftTables(t, hosts[0]); len(tabs) != 1 || tabs[0] != "overlayd" {
		t.Fatalf("nft tables %v, want overlayd", tabs)
	}
	waitKeys(t, o)
	mustEndpoint(t, d, "enc", "local", "198.51.100.2/24")
	mustJoin(t, d, "enc", "local")
	remote := netip.MustParseAddr("192.0.2.77")
	p := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.9"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: remote}
	if err := applyPeerEvent(d, PeerEvent{VNI: 700, Next: &p}); err != nil {
		t.Fatal(err)
	}
	// The policy is installed although its SA cannot be: with no SA it
	// drops, it never lets the packet leave in clear.
	if !policyTo(t, hosts[0], remote) {
		t.Fatalf("no outbound policy to %v: %+v", remote, xfrmPolicies(t, hosts[0]))
	}
	if st := d.Status().Encryption; st == nil || st.Error == "" || !st.ESPUnsupported {
		t.Fatalf("status does not report the missing ESP: %+v", st)
	}
	if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "enc"}); err != nil {
		t.Fatal(err)
	}
	if err := nstest.Eventually(5*time.Second, 10*time.Millisecond, func() error {
		if tabs := nftTables(t, hosts[0]); len(tabs) != 0 {
			return fmt.Errorf("nft tables left after delete: %v", tabs)
		}
		if policyTo(t, hosts[0], remote) {
			return errors.New("policy to the remote left after delete")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	mustAudit(t, d)
}

// A Join that fails after its local endpoint shadowed a remote claimant
// rolls everything back, the encryption state of that remote's host
// included (before, the neighbour came back but its policy and SAs did
// not until the next peer event).
func TestJoinRollbackRestoresEncryption(t *testing.T) {
	if encryption.CheckKernelSupport() == nil {
		t.Skip("this kernel can encrypt; the VM suite runs the real path")
	}
	hosts, vteps := nstest.Hosts(t, 1, false)
	st := openStore(t, t.TempDir())
	o := newOwner(t, hosts[0], vteps[0], func() error { return nil })
	d, err := New(alone(Config{HostNS: hosts[0].Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: vteps[0], Logger: testLogger(),
		Peers: newMemSource(), Encryption: o, StateFile: st}))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	keyhub.New().Attach(vteps[0], o)
	waitKeys(t, o)
	mustCreate(t, d, encReq("enc", "701", "198.51.100.0/24"))
	mustEndpoint(t, d, "enc", "first", "198.51.100.2/24")
	mustJoin(t, d, "enc", "first")
	// The only peer of host R claims 198.51.100.9, which the next local
	// endpoint will claim too (and win: local always wins).
	remote := netip.MustParseAddr("192.0.2.78")
	p := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.9"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: remote}
	if err := applyPeerEvent(d, PeerEvent{VNI: 701, Next: &p}); err != nil {
		t.Fatal(err)
	}
	if !policyTo(t, hosts[0], remote) {
		t.Fatal("no policy to the remote before the Join")
	}
	mustEndpoint(t, d, "enc", "dup", "198.51.100.9/24")
	st.Close() // the Join's state write fails after the local entry shadowed R's peer
	if _, err := d.Join(&api.JoinRequest{NetworkID: "enc", EndpointID: "dup"}); err == nil {
		t.Fatal("Join with a failing state file succeeded")
	}
	wantPeers(t, d, "enc", map[string]string{"198.51.100.9": "02:00:00:00:00:09"}, map[string]string{"02:00:00:00:00:09": "192.0.2.78"})
	if !policyTo(t, hosts[0], remote) {
		t.Fatal("the rolled-back Join left the remote host without its policy")
	}
	if pr := o.Audit(); len(pr) != 0 && !strings.Contains(strings.Join(pr, "\n"), "SA") {
		t.Fatalf("encryption audit after the rollback: %v", pr)
	}
}

// TestEncryptedNetworkRealPath runs only on a kernel that can encrypt (the
// VM suite runs it under Debian's kernel): two hosts whose encryption
// owners gossip through a hub, an encrypted network, containers ping each
// other through ESP, a cluster-wide key rotation during a continuous ping
// loses nothing, and removing the peer removes its policy.
func TestEncryptedNetworkRealPath(t *testing.T) {
	if err := encryption.CheckKernelSupport(); err != nil {
		t.Skipf("this kernel cannot encrypt (the VM suite runs this test): %v", err)
	}
	hosts, vteps := nstest.Hosts(t, 2, false)
	hub := keyhub.New()
	var ds []*Driver
	var os []*encryption.Owner
	var ctrs []*nstest.NS
	var peers []peerdb.Peer
	for i := range hosts {
		d, o := encDriver(t, hosts[i], vteps[i], nil, hub)
		ds, os = append(ds, d), append(os, o)
		mustCreate(t, d, encReq("enc", "700", "198.51.100.0/24"))
		addr := netip.MustParsePrefix(fmt.Sprintf("198.51.100.%d/24", 10+i))
		eid := fmt.Sprintf("e%d", i)
		mac := mustEndpoint(t, d, "enc", eid, addr.String())
		resp := mustJoin(t, d, "enc", eid)
		ctrs = append(ctrs, nstest.Container(t, eid, hosts[i], resp.InterfaceName.SrcName, addr, nil))
		m, _ := peerdb.ParseMAC(mac)
		peers = append(peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: m, VTEP: vteps[i]})
	}
	for _, o := range os {
		waitKeys(t, o)
	}
	for i, d := range ds {
		if err := applyPeerEvent(d, PeerEvent{VNI: 700, Next: &peers[1-i]}); err != nil {
			t.Fatal(err)
		}
	}
	if err := nstest.PingEventually(ctrs[0], peers[1].IP, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	for _, d := range ds {
		mustAudit(t, d)
	}
	st := ds[0].Status().Encryption
	if st == nil || len(st.Pairs) != 1 || st.Pairs[0].SendSA.Packets == 0 {
		t.Fatalf("SA counters did not rise: %+v", st)
	}

	// Rotate cluster-wide during a continuous ping.
	pl := nstest.StartPingLoop(ctrs[0], peers[1].IP, 10*time.Millisecond, 500*time.Millisecond)
	pl.WaitSent(10)
	start := time.Now()
	before := os[0].Status().Send
	target, err := os[0].Rotate()
	if err != nil {
		t.Fatal(err)
	}
	if err := nstest.Eventually(20*time.Second, 10*time.Millisecond, func() error {
		for i, o := range os {
			if st := o.Status(); st.Send != target || len(st.Accept) != 1 {
				return fmt.Errorf("host %d: %+v", i, st)
			}
		}
		return nil
	}); err != nil {
		t.Fatalf("rotation %d → %d did not complete: %v", before, target, err)
	}
	rotation := time.Since(start)
	pl.WaitSent(pl.Sent() + 10)
	sent, lost := pl.Stop()
	t.Logf("FIGURE: driver key rotation %d → %d on 2 hosts took %v; pings lost during it: %d of %d", before, target, rotation.Round(time.Millisecond), lost, sent)
	if lost != 0 {
		t.Errorf("%d of %d pings lost during the key rotation", lost, sent)
	}
	for _, d := range ds {
		mustAudit(t, d)
	}
	// Removing the peer removes its policy (its SAs may stay until the
	// next rotation, so that a peer that comes back reuses them).
	if err := applyPeerEvent(ds[0], PeerEvent{VNI: 700, Prev: &peers[1]}); err != nil {
		t.Fatal(err)
	}
	if policyTo(t, hosts[0], vteps[1]) {
		t.Fatal("policy to the removed peer's host left")
	}
	mustAudit(t, ds[0])
}
