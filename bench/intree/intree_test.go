//go:build linux

package intree

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/docker/docker/libnetwork/discoverapi"
	"github.com/docker/docker/libnetwork/driverapi"
	"github.com/docker/docker/libnetwork/drivers/overlay"
	"github.com/docker/docker/libnetwork/netlabel"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// childEnv marks the re-executed test binary that runs inside its own
// network and mount namespaces.
const childEnv = "OVERLAYD_INTREE_CHILD"

// TestMain re-executes the test binary in a new network namespace and a
// private mount namespace: the in-tree driver programs the namespace of its
// process (its netlink handle is bound to it at first use) and mounts its
// sandboxes under /var/run/docker/netns. Both namespaces are anonymous, so
// whatever the driver leaves vanishes with the child process, also when it
// crashes; the host's namespaces and /run are never touched.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "" {
		if os.Geteuid() != 0 {
			fmt.Println("skipped: the in-tree driver needs root (network namespaces, netlink)")
			os.Exit(0)
		}
		cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
		cmd.Env = append(os.Environ(), childEnv+"=1")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWNET | unix.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Run(); err != nil {
			if ee, ok := err.(*exec.ExitError); ok {
				os.Exit(ee.ExitCode())
			}
			fmt.Fprintln(os.Stderr, "re-executing in new namespaces:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if err := setupChild(); err != nil {
		fmt.Fprintln(os.Stderr, "setting up the benchmark's namespaces:", err)
		os.Exit(1)
	}
	log.L.Logger.SetOutput(io.Discard) // the driver logs every iptables call it cannot make
	os.Exit(m.Run())
}

// setupChild makes the mounts private (nothing propagates to the host),
// puts a tmpfs over /run (the driver's /var/run/docker/netns lives there),
// brings up loopback and gives the namespace an underlay address from
// 192.0.2.0/24 on a bridge (the kernel here has no dummy links).
func setupChild() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	if err := unix.Mount("tmpfs", "/run", "tmpfs", 0, "size=16m"); err != nil {
		return fmt.Errorf("tmpfs on /run: %w", err)
	}
	lo, err := netlink.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "underlay0", Flags: net.FlagUp}}
	if err := netlink.LinkAdd(br); err != nil {
		return fmt.Errorf("underlay bridge: %w", err)
	}
	addr, _ := netlink.ParseAddr(underlayAddr + "/24")
	if err := netlink.AddrAdd(br, addr); err != nil {
		return fmt.Errorf("underlay address: %w", err)
	}
	return nil
}

const underlayAddr = "192.0.2.10"

// registry receives the driver from overlay.Register.
type registry struct{ d driverapi.Driver }

func (r *registry) RegisterDriver(_ string, d driverapi.Driver, _ driverapi.Capability) error {
	r.d = d
	return nil
}

// iface plays libnetwork's endpoint interface: an address, a MAC the
// driver sets.
type iface struct {
	addr *net.IPNet
	mac  net.HardwareAddr
}

func (i *iface) SetMacAddress(mac net.HardwareAddr) error { i.mac = mac; return nil }
func (i *iface) SetIPAddress(*net.IPNet) error            { return nil }
func (i *iface) MacAddress() net.HardwareAddr             { return i.mac }
func (i *iface) Address() *net.IPNet                      { return i.addr }
func (i *iface) AddressIPv6() *net.IPNet                  { return nil }
func (i *iface) NetnsPath() string                        { return "" }
func (i *iface) SetCreatedInContainer(bool)               {}

// joinInfo plays libnetwork's side of Join: it accepts what the driver
// hands back and keeps nothing.
type joinInfo struct{}

type names struct{}

func (names) SetNames(string, string, string) error { return nil }

func (joinInfo) InterfaceName() driverapi.InterfaceNameInfo            { return names{} }
func (joinInfo) SetGateway(net.IP) error                               { return nil }
func (joinInfo) SetGatewayIPv6(net.IP) error                           { return nil }
func (joinInfo) AddStaticRoute(*net.IPNet, int, net.IP) error          { return nil }
func (joinInfo) DisableGatewayService()                                {}
func (joinInfo) AddTableEntry(tableName, key string, val []byte) error { return nil }

// newDriver registers a fresh in-tree overlay driver that knows its own
// node (as swarm's DiscoverNew tells it).
func newDriver(b *testing.B) driverapi.Driver {
	b.Helper()
	r := &registry{}
	if err := overlay.Register(r, nil); err != nil {
		b.Fatal(err)
	}
	disc, ok := r.d.(discoverapi.Discover)
	if !ok {
		b.Fatalf("the in-tree driver %T does not take discovery events", r.d)
	}
	err := disc.DiscoverNew(discoverapi.NodeDiscovery, discoverapi.NodeDiscoveryData{Address: underlayAddr, BindAddress: underlayAddr, Self: true})
	if err != nil {
		b.Fatal(err)
	}
	return r.d
}

var netSeq int

// createNetwork creates a network of one subnet with the given VNI, as
// swarm would hand it to every node.
func createNetwork(b *testing.B, d driverapi.Driver, vni uint32, pool string) string {
	b.Helper()
	netSeq++
	id := fmt.Sprintf("%025d", netSeq) // swarm network ids are 25 characters
	_, p, err := net.ParseCIDR(pool)
	if err != nil {
		b.Fatal(err)
	}
	gw := &net.IPNet{IP: append(net.IP(nil), p.IP.To4()...), Mask: p.Mask}
	gw.IP[3]++
	opts := map[string]interface{}{netlabel.GenericData: map[string]string{netlabel.OverlayVxlanIDList: strconv.FormatUint(uint64(vni), 10)}}
	ipam := []driverapi.IPAMData{{AddressSpace: "GlobalDefault", Pool: p, Gateway: gw}}
	if err := d.CreateNetwork(context.Background(), id, opts, nil, ipam, nil); err != nil {
		b.Fatalf("CreateNetwork: %v", err)
	}
	b.Cleanup(func() { d.DeleteNetwork(id) })
	return id
}

func endpoint(b *testing.B, d driverapi.Driver, nid, eid, addr string) {
	b.Helper()
	ip, p, err := net.ParseCIDR(addr)
	if err != nil {
		b.Fatal(err)
	}
	p.IP = ip
	if err := d.CreateEndpoint(context.Background(), nid, eid, &iface{addr: p}, nil); err != nil {
		b.Fatalf("CreateEndpoint %s: %v", eid, err)
	}
}

func join(b *testing.B, d driverapi.Driver, nid, eid string) {
	b.Helper()
	if err := d.Join(context.Background(), nid, eid, "/var/run/docker/netns/bench", joinInfo{}, nil, nil); err != nil {
		b.Fatalf("Join %s: %v", eid, err)
	}
}

// leaveDelete is what dockerd sends when a container stops: Leave, then
// DeleteEndpoint (the in-tree driver deletes the veth in DeleteEndpoint).
// It returns how long the Leave alone took.
func leaveDelete(b *testing.B, d driverapi.Driver, nid, eid string) time.Duration {
	b.Helper()
	t0 := time.Now()
	if err := d.Leave(nid, eid); err != nil {
		b.Fatalf("Leave %s: %v", eid, err)
	}
	leave := time.Since(t0)
	if err := d.DeleteEndpoint(nid, eid); err != nil {
		b.Fatalf("DeleteEndpoint %s: %v", eid, err)
	}
	return leave
}

// The benchmarks below mirror overlayd's of the same names
// (driver/bench_test.go): same network, same timed calls, a new endpoint
// id every round as dockerd gives every container.

// BenchmarkJoinFirst measures the first Join of a network, which builds its
// sandbox (namespace, bridge, VXLAN) and the endpoint's veth.
func BenchmarkJoinFirst(b *testing.B) {
	d := newDriver(b)
	nid := createNetwork(b, d, 100, "198.51.100.0/24")
	benchJoins(b, d, nid, "198.51.100.2/24")
}

// BenchmarkJoinLater measures a Join into a network whose sandbox exists.
func BenchmarkJoinLater(b *testing.B) {
	d := newDriver(b)
	nid := createNetwork(b, d, 100, "198.51.100.0/24")
	endpoint(b, d, nid, "first", "198.51.100.2/24")
	join(b, d, nid, "first")
	benchJoins(b, d, nid, "198.51.100.3/24")
}

// benchJoins times, every round, the Join of a new endpoint of network nid
// with address addr; its Leave and DeleteEndpoint are done untimed.
func benchJoins(b *testing.B, d driverapi.Driver, nid, addr string) {
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		eid := fmt.Sprintf("e%d", i)
		b.StopTimer()
		endpoint(b, d, nid, eid, addr)
		b.StartTimer()
		join(b, d, nid, eid)
		b.StopTimer()
		leaveDelete(b, d, nid, eid)
		b.StartTimer()
	}
}

// BenchmarkLeaveLast measures the last Leave and its DeleteEndpoint, which
// tear the sandbox down (leave-ns/op: the Leave alone).
func BenchmarkLeaveLast(b *testing.B) {
	d := newDriver(b)
	nid := createNetwork(b, d, 100, "198.51.100.0/24")
	benchLeaves(b, d, nid, "198.51.100.2/24")
}

// BenchmarkLeaveVeth measures a Leave that is not the network's last and
// its DeleteEndpoint: only the endpoint's veth goes (leave-ns/op: the Leave
// alone).
func BenchmarkLeaveVeth(b *testing.B) {
	d := newDriver(b)
	nid := createNetwork(b, d, 100, "198.51.100.0/24")
	endpoint(b, d, nid, "first", "198.51.100.2/24")
	join(b, d, nid, "first")
	benchLeaves(b, d, nid, "198.51.100.3/24")
}

// benchLeaves times, every round, the Leave and DeleteEndpoint of a new
// endpoint of network nid with address addr, joined untimed.
func benchLeaves(b *testing.B, d driverapi.Driver, nid, addr string) {
	var leave time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		eid := fmt.Sprintf("e%d", i)
		b.StopTimer()
		endpoint(b, d, nid, eid, addr)
		join(b, d, nid, eid)
		b.StartTimer()
		leave += leaveDelete(b, d, nid, eid)
	}
	b.ReportMetric(float64(leave.Nanoseconds())/float64(b.N), "leave-ns/op")
}

// BenchmarkLeaveBurst measures 32 containers of one network stopping at
// once (Leave and DeleteEndpoint of each, the network keeping one joined
// endpoint); the in-tree driver deletes each veth within DeleteEndpoint.
func BenchmarkLeaveBurst(b *testing.B) {
	const burst = 32
	d := newDriver(b)
	nid := createNetwork(b, d, 100, "198.51.100.0/24")
	endpoint(b, d, nid, "first", "198.51.100.2/24")
	join(b, d, nid, "first")
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		for j := 0; j < burst; j++ {
			eid := fmt.Sprintf("e%d-%d", i, j)
			endpoint(b, d, nid, eid, fmt.Sprintf("198.51.100.%d/24", 10+j))
			join(b, d, nid, eid)
		}
		b.StartTimer()
		for j := 0; j < burst; j++ {
			leaveDelete(b, d, nid, fmt.Sprintf("e%d-%d", i, j))
		}
	}
}
