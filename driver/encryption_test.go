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
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef")

func encDriver(t *testing.T, host *nstest.NS, adv netip.Addr, check func() error) *Driver {
	t.Helper()
	d, err := New(Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: adv, Logger: testLogger(),
		Secret: testSecret, CheckEncryption: check})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
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
	d := encDriver(t, hosts[0], vteps[0], nil)
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
// driver programs the fail-closed rules and policies, reports the missing
// SAs instead of sending in clear, and removes everything with the network.
// The real ESP path runs in the VM (TestEncryptedNetworkRealPath).
func TestEncryptedNetworkFailsClosedWithoutSAs(t *testing.T) {
	if encryption.CheckKernelSupport() == nil {
		t.Skip("this kernel can encrypt: TestEncryptedNetworkRealPath covers it")
	}
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := encDriver(t, hosts[0], vteps[0], func() error { return nil })
	mustCreate(t, d, encReq("enc", "700", "198.51.100.0/24"))
	if st := d.Status(); st.Networks[0].MTU != 1416 || !st.Networks[0].Encrypted {
		t.Fatalf("encrypted network status: %+v (want MTU 1416)", st.Networks[0])
	}
	if tabs := nftTables(t, hosts[0]); len(tabs) != 1 || tabs[0] != "overlayd" {
		t.Fatalf("nft tables %v, want overlayd", tabs)
	}
	mustEndpoint(t, d, "enc", "local", "198.51.100.2/24")
	mustJoin(t, d, "enc", "local")
	// Before any key, a remote peer gets no policy: the nft rule drops.
	p := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.9"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: netip.MustParseAddr("192.0.2.77")}
	if err := d.ApplyPeerEvent(PeerEvent{VNI: 700, Next: &p}); err != nil {
		t.Fatal(err)
	}
	if pols := xfrmPolicies(t, hosts[0]); len(pols) != 0 {
		t.Fatalf("policies without keys: %d", len(pols))
	}
	// Keys that need SAs fail clearly; the policy is installed anyway so
	// that marked traffic to the peer is dropped, never sent in clear.
	if err := d.SetKeys(encryption.NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}); !errors.Is(err, encryption.ErrKernelUnsupported) {
		t.Fatalf("SetKeys without ESP: %v", err)
	}
	if k := d.Keys(); k.Send != 0 {
		t.Fatalf("keys after a failed SetKeys: %v (the control plane must not advertise them)", k)
	}
	if st := d.Status().Encryption; st == nil || st.Error == "" {
		t.Fatalf("status does not report the encryption error: %+v", st)
	}
	if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "enc"}); err != nil {
		t.Fatal(err)
	}
	if tabs := nftTables(t, hosts[0]); len(tabs) != 0 {
		t.Fatalf("nft tables left after delete: %v", tabs)
	}
	if pols := xfrmPolicies(t, hosts[0]); len(pols) != 0 {
		t.Fatalf("policies left after delete: %d", len(pols))
	}
	mustAudit(t, d)
}

// TestEncryptedNetworkRealPath runs only on a kernel that can encrypt (the
// VM suite runs it under Debian's kernel): two hosts, an encrypted network,
// containers ping each other through ESP, a key rotation during a
// continuous ping loses nothing, and removing the peer removes its SAs and
// policies.
func TestEncryptedNetworkRealPath(t *testing.T) {
	if err := encryption.CheckKernelSupport(); err != nil {
		t.Skipf("this kernel cannot encrypt (the VM suite runs this test): %v", err)
	}
	hosts, vteps := nstest.Hosts(t, 2, false)
	var ds []*Driver
	var ctrs []*nstest.NS
	var peers []peerdb.Peer
	for i := range hosts {
		d := encDriver(t, hosts[i], vteps[i], nil)
		ds = append(ds, d)
		mustCreate(t, d, encReq("enc", "700", "198.51.100.0/24"))
		if err := d.SetKeys(encryption.NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}); err != nil {
			t.Fatal(err)
		}
		addr := netip.MustParsePrefix(fmt.Sprintf("198.51.100.%d/24", 10+i))
		eid := fmt.Sprintf("e%d", i)
		mac := mustEndpoint(t, d, "enc", eid, addr.String())
		resp := mustJoin(t, d, "enc", eid)
		ctrs = append(ctrs, nstest.Container(t, eid, hosts[i], resp.InterfaceName.SrcName, addr, nil))
		m, _ := peerdb.ParseMAC(mac)
		peers = append(peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: m, VTEP: vteps[i]})
	}
	for i, d := range ds {
		if err := d.ApplyPeerEvent(PeerEvent{VNI: 700, Next: &peers[1-i]}); err != nil {
			t.Fatal(err)
		}
		mustAudit(t, d)
	}
	if err := nstest.PingEventually(ctrs[0], peers[1].IP, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	st := ds[0].Status().Encryption
	if st == nil || len(st.Pairs) != 1 || st.Pairs[0].SendSA.Packets == 0 {
		t.Fatalf("SA counters did not rise: %+v", st)
	}

	// Rotate during a continuous ping: accept 2 everywhere, send 2
	// everywhere, retire 1 everywhere.
	pl := nstest.StartPingLoop(ctrs[0], peers[1].IP, 10*time.Millisecond, 500*time.Millisecond)
	waitPings := pl.WaitSent
	waitPings(10)
	start := time.Now()
	for _, step := range []encryption.NodeKeys{
		{Accept: []uint32{1, 2}, Send: 1, Target: 2},
		{Accept: []uint32{1, 2}, Send: 2, Target: 2},
		{Accept: []uint32{2}, Send: 2, Target: 2},
	} {
		for _, d := range ds {
			if err := d.SetKeys(step); err != nil {
				t.Fatal(err)
			}
		}
		waitPings(10)
	}
	rotation := time.Since(start)
	sent, lost := pl.Stop()
	t.Logf("FIGURE: driver key rotation on 2 hosts took %v (3 steps); pings lost during it: %d of %d", rotation.Round(time.Millisecond), lost, sent)
	if lost != 0 {
		t.Errorf("%d of %d pings lost during the key rotation", lost, sent)
	}
	for _, d := range ds {
		mustAudit(t, d)
	}
	// Removing the peer removes its SAs and policies.
	if err := ds[0].ApplyPeerEvent(PeerEvent{VNI: 700, Prev: &peers[1]}); err != nil {
		t.Fatal(err)
	}
	if st := ds[0].Status().Encryption; st == nil || len(st.Pairs) != 0 {
		t.Fatalf("pairs after the peer left: %+v", st)
	}
	if pols := xfrmPolicies(t, hosts[0]); len(pols) != 0 {
		t.Fatalf("%d policies left after the peer left", len(pols))
	}
	mustAudit(t, ds[0])
}
