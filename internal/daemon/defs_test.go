package daemon

import (
	"bytes"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/testutil/logbuf"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// defsGossipPort is the gossip port of the in-process hosts below; each
// gossips on its own loopback address of the test's namespace.
const defsGossipPort = 17991

// defHost is one in-process overlayd host: a driver in its own namespace
// (VTEP 192.0.2.1x on the test underlay), its encryption owner, and its
// control plane, whose gossip uses a loopback address of the test's
// namespace (so that memberlist's sockets, made on any thread, work).
type defHost struct {
	name   string
	ns     *nstest.NS
	vtep   netip.Addr
	gossip string
	cp     *controlPlane
	d      *driver.Driver
	enc    *encryption.Owner
	logs   *logbuf.Buffer
}

func startDefHost(t *testing.T, name string, ns *nstest.NS, vtep netip.Addr, gossipIP string, join ...string) *defHost {
	t.Helper()
	h := &defHost{name: name, ns: ns, vtep: vtep, gossip: net.JoinHostPort(gossipIP, strconv.Itoa(defsGossipPort)), logs: &logbuf.Buffer{}}
	// The settings the control plane reads (made directly: a loopback
	// address other than 127.0.0.1 is this host's, but not an interface
	// address a settings check would find).
	st := &config.Settings{NodeName: name, GossipAddr: netip.MustParseAddr(gossipIP), GossipPort: defsGossipPort, Join: join}
	log := slog.New(slog.NewTextHandler(h.logs, &slog.HandlerOptions{Level: slog.LevelInfo})).With("host", name)
	key := []byte("0123456789abcdef0123456789abcdef")
	// This kernel has xfrm policies but no ESP states: a stand-in passes
	// the check, and traffic that needs an SA is dropped (never clear).
	var err error
	h.enc, err = encryption.NewOwner(encryption.OwnerConfig{NS: ns.Handle, Port: driver.DefaultVXLANPort, Secret: key,
		Logger: log, CheckKernel: func() error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.enc.Close)
	if err := h.enc.SetLocal(vtep); err != nil {
		t.Fatal(err)
	}
	h.enc.Start()
	link := newClusterLink(st, log, h.enc)
	h.d, err = driver.New(driver.Config{HostNS: ns.Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: vtep, Logger: log,
		Publisher: link, Peers: link, Definitions: link, Membership: link, Encryption: h.enc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.d.Close() })
	h.cp = newControlPlane(st, nil, log, key, h.enc, nil, link, h.d, nil, nil)
	h.cp.tryStart()
	if link.c.Load() == nil {
		t.Fatalf("%s: the control plane did not start:\n%s", name, h.logs.String())
	}
	t.Cleanup(h.cp.close)
	return h
}

// netReq is a CreateNetwork request for vni with pool and its .1 gateway;
// opts are added as -o options.
func netReq(id string, vni uint32, pool string, opts map[string]string) *api.CreateNetworkRequest {
	p := netip.MustParsePrefix(pool)
	generic := map[string]interface{}{driver.OptVNI: strconv.Itoa(int(vni))}
	for k, v := range opts {
		generic[k] = v
	}
	return &api.CreateNetworkRequest{NetworkID: id, Options: map[string]interface{}{driver.OptGeneric: generic},
		IPv4Data: []*api.IPAMData{{AddressSpace: "GlobalDefault", Pool: p.String(), Gateway: fmt.Sprintf("%s/%d", p.Addr().Next(), p.Bits())}}}
}

// waitDefinition waits until h has host's definition of vni.
func (h *defHost) waitDefinition(t *testing.T, host string, vni uint32) {
	t.Helper()
	if err := nstest.Eventually(15*time.Second, 10*time.Millisecond, func() error {
		for _, r := range h.cp.link.Definitions(vni) {
			if r.Host == host && !r.Pending {
				return nil
			}
		}
		return fmt.Errorf("%s has no definition of VNI %d from %s: %+v", h.name, vni, host, h.cp.link.Definitions(vni))
	}); err != nil {
		t.Fatal(err)
	}
}

// container joins endpoint eid of network nid with addr and plays
// dockerd's part: the container namespace with the link moved in.
func (h *defHost) container(t *testing.T, nid, eid, addr string) *nstest.NS {
	t.Helper()
	if _, err := h.d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: nid, EndpointID: eid, Interface: &api.EndpointInterface{Address: addr}}); err != nil {
		t.Fatal(err)
	}
	resp, err := h.d.Join(&api.JoinRequest{NetworkID: nid, EndpointID: eid, SandboxKey: "/var/run/docker/netns/" + eid})
	if err != nil {
		t.Fatal(err)
	}
	return nstest.Container(t, "c"+eid, h.ns, resp.InterfaceName.SrcName, netip.MustParsePrefix(addr), nil)
}

func networkStatus(t *testing.T, h *defHost, id string) driver.NetworkStatus {
	t.Helper()
	for _, n := range h.d.Status().Networks {
		if n.ID == id {
			return n
		}
	}
	t.Fatalf("%s has no network %s", h.name, id)
	return driver.NetworkStatus{}
}

// A CreateNetwork whose definition contradicts another host's definition
// of the VNI (another subnet, MTU, encryption or internal flag) is refused,
// naming that host, its VTEP and what differs; the same definition is
// accepted. Before, each was accepted and traffic silently failed.
func TestCreateNetworkRefusedWhenAnotherHostDefinesTheVNIDifferently(t *testing.T) {
	nstest.RequireRoot(t)
	hosts, vteps := nstest.Hosts(t, 2, false)
	a := startDefHost(t, "defs-a", hosts[0], vteps[0], "127.0.0.171")
	b := startDefHost(t, "defs-b", hosts[1], vteps[1], "127.0.0.172", a.gossip)
	if err := a.d.CreateNetwork(netReq("net-a", 5100, "198.51.100.0/24", nil)); err != nil {
		t.Fatal(err)
	}
	b.waitDefinition(t, a.name, 5100)

	for _, tc := range []struct {
		name string
		req  *api.CreateNetworkRequest
		want string
	}{
		{"other subnet", netReq("net-b", 5100, "203.0.113.0/24", nil),
			"subnets: [VNI 5100 203.0.113.0/24 gw 203.0.113.1] here, [VNI 5100 198.51.100.0/24 gw 198.51.100.1] there"},
		{"other MTU", netReq("net-b", 5100, "198.51.100.0/24", map[string]string{driver.OptMTU: "1400"}), "MTU: 1400 here, 1450 there"},
		{"encrypted here only", netReq("net-b", 5100, "198.51.100.0/24", map[string]string{driver.OptEncrypted: ""}), "encrypted: yes here, no there"},
	} {
		err := b.d.CreateNetwork(tc.req)
		if err == nil {
			t.Fatalf("%s: a contradicting CreateNetwork was accepted", tc.name)
		}
		for _, want := range []string{`host "defs-a"`, "VTEP 192.0.2.10", "VNI 5100", tc.want} {
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("%s: error %q does not say %q", tc.name, err, want)
			}
		}
		if len(b.d.Status().Networks) != 0 {
			t.Fatalf("%s: the refused network was registered", tc.name)
		}
	}
	// An internal network's definition differs too.
	internal := netReq("net-b", 5100, "198.51.100.0/24", nil)
	internal.Options[driver.OptInternal] = true
	if err := b.d.CreateNetwork(internal); err == nil || !strings.Contains(err.Error(), "internal: yes here, no there") {
		t.Fatalf("internal network with a non-internal definition elsewhere: %v", err)
	}
	// The same definition is accepted, and nothing is reported.
	if err := b.d.CreateNetwork(netReq("net-b", 5100, "198.51.100.0/24", nil)); err != nil {
		t.Fatalf("the same definition was refused: %v", err)
	}
	a.waitDefinition(t, b.name, 5100)
	a.cp.reconcile()
	if c := networkStatus(t, a, "net-a").DefinitionConflicts; len(c) != 0 {
		t.Fatalf("agreeing definitions reported as conflicts: %+v", c)
	}
}

// Two hosts that created one VNI differently while apart (here: before
// they joined; encrypted on one, clear on the other) find out when they
// meet: each logs it once at WARN naming the VNI, the other host and the
// difference, shows it in status, and refuses the other's records of the
// VNI, so no packet of the VNI crosses the underlay in clear. Before, each
// programmed the other's peers: the clear host sent the VNI's traffic in
// clear to the host that encrypts it. When one deletes its network, the
// other logs the end of the contradiction once.
func TestContradictionFoundLaterIsReportedAndNothingGoesInClear(t *testing.T) {
	nstest.RequireRoot(t)
	hosts, vteps := nstest.Hosts(t, 2, false)
	capture := nstest.StartCapture(t, hosts[0], "eth0", driver.DefaultVXLANPort)
	a := startDefHost(t, "defs-enc", hosts[0], vteps[0], "127.0.0.173")
	b := startDefHost(t, "defs-clear", hosts[1], vteps[1], "127.0.0.174")
	const vni = 5200
	if err := a.d.CreateNetwork(netReq("net", vni, "198.51.100.0/24", map[string]string{driver.OptEncrypted: ""})); err != nil {
		t.Fatal(err)
	}
	// The same MTU, so that encryption is the only difference.
	if err := b.d.CreateNetwork(netReq("net", vni, "198.51.100.0/24", map[string]string{driver.OptMTU: strconv.Itoa(networkStatus(t, a, "net").MTU)})); err != nil {
		t.Fatal(err)
	}
	ca := a.container(t, "net", "ea", "198.51.100.2/24")
	cb := b.container(t, "net", "eb", "198.51.100.3/24")

	b.cp.link.c.Load().AddSeeds(a.gossip) // the partition heals
	a.waitDefinition(t, b.name, vni)
	b.waitDefinition(t, a.name, vni)
	for _, h := range []*defHost{a, b} {
		h.cp.reconcile() // pull again: still logged once
	}
	for _, tc := range []struct {
		h, other *defHost
		diff     string
	}{{a, b, "encrypted: yes here, no there"}, {b, a, "encrypted: no here, yes there"}} {
		if n := tc.h.logs.Count("level=WARN", "event=conflict_found", "kind=definition", "vni=5200", "member="+tc.other.name, tc.diff); n != 1 {
			t.Errorf("%s logged the contradiction %d times, want once:\n%s", tc.h.name, n, tc.h.logs.String())
		}
		ns := networkStatus(t, tc.h, "net")
		if len(ns.DefinitionConflicts) != 1 || ns.DefinitionConflicts[0].Host != tc.other.name ||
			ns.DefinitionConflicts[0].VTEP != tc.other.vtep.String() || ns.DefinitionConflicts[0].RefusedRecords != 1 ||
			!strings.Contains(strings.Join(ns.DefinitionConflicts[0].Differences, ";"), tc.diff) {
			t.Errorf("%s's status shows the conflicts %+v, want %s's with %q and its 1 record refused", tc.h.name, ns.DefinitionConflicts, tc.other.name, tc.diff)
		}
		if len(ns.RemotePeers) != 0 {
			t.Errorf("%s took the records of a host that contradicts it: %+v", tc.h.name, ns.RemotePeers)
		}
		var text bytes.Buffer
		(&StatusReport{Driver: tc.h.d.Status()}).Render(&text)
		if want := fmt.Sprintf("definition contradicted: vni 5200 on host %s (VTEP %s): ", tc.other.name, tc.other.vtep); !strings.Contains(text.String(), want) {
			t.Errorf("%s's status text lacks %q:\n%s", tc.h.name, want, text.String())
		}
	}
	// Traffic both ways: nothing arrives, and nothing of the VNI is on the
	// underlay in clear.
	if err := nstest.Ping(cb, netip.MustParseAddr("198.51.100.2"), time.Second); err == nil {
		t.Errorf("the clear host reached the encrypted host's container")
	}
	if err := nstest.Ping(ca, netip.MustParseAddr("198.51.100.3"), time.Second); err == nil {
		t.Errorf("the encrypted host reached the clear host's container")
	}
	if n := capture.ClearOf(vni); n != 0 {
		t.Errorf("%d clear VXLAN packets of the encrypted VNI %d on the underlay", n, vni)
	}
	// The clear host deletes its network: the other logs the end of the
	// contradiction once at INFO.
	for _, err := range []error{
		b.d.Leave(&api.LeaveRequest{NetworkID: "net", EndpointID: "eb"}),
		b.d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: "net", EndpointID: "eb"}),
		b.d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "net"}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	resolved := func() int {
		return a.logs.Count("level=INFO", "event=conflict_resolved", "kind=definition", "vni=5200", "member="+b.name)
	}
	if err := nstest.Eventually(15*time.Second, 100*time.Millisecond, func() error {
		a.cp.reconcile()
		if resolved() == 0 {
			return fmt.Errorf("%s has not logged the end of the contradiction", a.name)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	a.cp.reconcile()
	if n := resolved(); n != 1 {
		t.Errorf("%s logged the end of the contradiction %d times, want once", a.name, n)
	}
	if t.Failed() {
		t.Logf("logs of %s:\n%s\nlogs of %s:\n%s", a.name, a.logs.String(), b.name, b.logs.String())
	}
}
