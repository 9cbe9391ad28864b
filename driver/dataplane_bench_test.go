package driver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// The data-plane benchmark (make bench-dataplane): TCP throughput (iperf3,
// one and four streams) and request/response latency between two namespace
// "hosts" joined by one veth, over three paths measured in interleaved
// rounds:
//
//   - underlay: host to host over the veth itself;
//   - vxlan: a VXLAN link made by hand in each host (same UDP port and MTU
//     as overlayd's, the next VNI: two links of one VNI and port cannot share
//     a namespace), addressed directly;
//   - overlayd: two containers, one per host, joined to an overlayd network
//     by the driver in-process, peers injected as the gossip would.
//
// Every round measures each kind of traffic on the three paths back to
// back, so the ratios of one round compare moments seconds apart: on a
// shared machine the absolute figures drift, the ratios much less.
//
// Settings (environment): OVERLAYD_BENCH_DATAPLANE=1 runs it (skipped
// otherwise, so that make test compiles it but never runs it);
// OVERLAYD_BENCH_ROUNDS (3), OVERLAYD_BENCH_SECONDS per measurement (5),
// OVERLAYD_BENCH_FAMILIES, the underlay's address families ("4,6");
// OVERLAYD_BENCH_TRY_SANDBOX and OVERLAYD_BENCH_TRY_CONTAINER, shell
// commands that change a second overlayd network's sandboxes and
// containers, measured as a fourth path ("try") in the same rounds;
// OVERLAYD_BENCH_SETTINGS=1 prints every link's settings and offloads.
func TestBenchDataplane(t *testing.T) {
	if os.Getenv("OVERLAYD_BENCH_DATAPLANE") == "" {
		t.Skip("data-plane benchmark: run it with make bench-dataplane (OVERLAYD_BENCH_DATAPLANE=1)")
	}
	nstest.RequireRoot(t)
	if _, err := exec.LookPath("iperf3"); err != nil {
		t.Fatalf("iperf3 not found (make bench-dataplane installs Debian's iperf3): %v", err)
	}
	if _, err := exec.LookPath("nsenter"); err != nil {
		t.Fatalf("nsenter not found (Debian's util-linux): %v", err)
	}
	cfg := dpConfig{rounds: envInt(t, "OVERLAYD_BENCH_ROUNDS", 3), seconds: envInt(t, "OVERLAYD_BENCH_SECONDS", 5)}
	// An interrupt (^C, SIGTERM) ends the measurement under way and fails
	// the test, so that its clean-ups remove every namespace, mount and
	// iperf3 process it made.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	families := os.Getenv("OVERLAYD_BENCH_FAMILIES")
	if families == "" {
		families = "4,6"
	}
	for _, f := range strings.Split(families, ",") {
		switch strings.TrimSpace(f) {
		case "4":
			t.Run("ipv4", func(t *testing.T) { benchDataplane(ctx, t, cfg, false) })
		case "6":
			t.Run("ipv6", func(t *testing.T) { benchDataplane(ctx, t, cfg, true) })
		default:
			t.Fatalf("OVERLAYD_BENCH_FAMILIES=%q: want a list of 4 and 6", families)
		}
		if ctx.Err() != nil {
			t.Fatal("interrupted")
		}
	}
}

type dpConfig struct{ rounds, seconds int }

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// dpPath is one of the compared paths: traffic from client to server's
// address.
type dpPath struct {
	name           string
	client, server *nstest.NS
	addr           netip.Addr
}

const (
	dpIperfPort = 5201
	dpRRPort    = 5301
	dpVNI       = 4242
)

// dpKinds are the kinds of traffic, measured in this order in each round;
// each gives figures of one or more series.
var dpKinds = []struct {
	streams int // iperf3 streams; 0 for request/response
	series  []int
}{
	{1, []int{0, 1}},
	{4, []int{2, 3}},
	{0, []int{4, 5}},
}

// dpSeries are the figures printed. The throughput per CPU-second (the
// CPU time of iperf3's client and server, which includes the kernel's
// work on their behalf, softirqs in their context included) depends less
// on what else the machine runs than the throughput does.
var dpSeries = []struct{ name, unit string }{
	{"TCP, 1 stream", "Gbit/s"},
	{"TCP, 1 stream, per CPU-second", "Gbit"},
	{"TCP, 4 streams", "Gbit/s"},
	{"TCP, 4 streams, per CPU-second", "Gbit"},
	{"TCP request/response, 1 byte", "k/s"},
	{"TCP request/response, median latency", "µs, lower is better"},
}

func benchDataplane(ctx context.Context, t *testing.T, cfg dpConfig, v6 bool) {
	hosts, vteps := nstest.Pair(t, v6)

	var drivers []*Driver
	for i, h := range hosts {
		drivers = append(drivers, newTestDriver(t, h, vteps[i]))
	}
	// overlayd: a network on both hosts, a container on each.
	ctrs, peerIP := dpNetwork(t, hosts, drivers, "bench", dpVNI, "198.51.100.0/25")
	mtu := drivers[0].Status().Networks[0].MTU
	var paths []dpPath
	paths = append(paths, dpPath{name: "underlay", client: hosts[0], server: hosts[1], addr: vteps[1]})

	// The hand-made VXLAN link: a point-to-point one (its default
	// destination is the other host), learning off as overlayd's.
	for i, h := range hosts {
		vx := &netlink.Vxlan{
			LinkAttrs: netlink.LinkAttrs{Name: "vxhand", MTU: mtu, TxQLen: -1},
			VxlanId:   dpVNI + 1,
			Port:      drivers[i].cfg.VXLANPort,
			Group:     vteps[1-i].AsSlice(),
		}
		if err := h.NL.LinkAdd(vx); err != nil {
			t.Fatalf("host %d: hand-made VXLAN: %v", i, err)
		}
		a := netip.MustParsePrefix(fmt.Sprintf("203.0.113.%d/24", 10+i))
		if err := h.NL.AddrAdd(vx, &netlink.Addr{IPNet: &net.IPNet{IP: a.Addr().AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
			t.Fatalf("host %d: hand-made VXLAN address: %v", i, err)
		}
		if err := h.NL.LinkSetUp(vx); err != nil {
			t.Fatalf("host %d: hand-made VXLAN up: %v", i, err)
		}
	}
	paths = append(paths,
		dpPath{name: "vxlan", client: hosts[0], server: hosts[1], addr: netip.MustParseAddr("203.0.113.11")},
		dpPath{name: "overlayd", client: ctrs[0], server: ctrs[1], addr: peerIP})
	// A second overlayd network, changed by hand (OVERLAYD_BENCH_TRY_*
	// commands run in its sandboxes and containers), measured beside the
	// first: what a setting changes.
	trySB, tryCtr := os.Getenv("OVERLAYD_BENCH_TRY_SANDBOX"), os.Getenv("OVERLAYD_BENCH_TRY_CONTAINER")
	if trySB != "" || tryCtr != "" {
		tctrs, tip := dpNetwork(t, hosts, drivers, "try", dpVNI+2, "198.51.100.128/25")
		for i, d := range drivers {
			sb := dpSandboxNS(t, d, "try")
			for _, c := range []struct {
				ns  *nstest.NS
				cmd string
			}{{sb, trySB}, {tctrs[i], tryCtr}} {
				if c.cmd == "" {
					continue
				}
				if out, err := commandIn(context.Background(), t, c.ns, "sh", "-c", c.cmd).CombinedOutput(); err != nil {
					t.Fatalf("%s in %s: %v: %s", c.cmd, c.ns.Name, err, out)
				}
			}
		}
		fmt.Printf("overlayd-try: sandboxes %q, containers %q\n", trySB, tryCtr)
		paths = append(paths, dpPath{name: "try", client: tctrs[0], server: tctrs[1], addr: tip})
	}
	for _, p := range paths {
		if err := nstest.PingEventually(p.client, p.addr, 10*time.Second); err != nil {
			t.Fatalf("%s: %v", p.name, err)
		}
	}
	family := "IPv4"
	if v6 {
		family = "IPv6"
	}
	fmt.Printf("\n== data plane, %s underlay: %d rounds, %d s per measurement, inner MTU %d\n", family, cfg.rounds, cfg.seconds, mtu)
	dpSettings(t, hosts, ctrs, drivers)

	// One iperf3 server and one request/response server per server
	// namespace (the underlay and the hand-made VXLAN share host1's).
	started := map[*nstest.NS]bool{}
	for _, p := range paths {
		if !started[p.server] {
			started[p.server] = true
			startIperfServer(t, p.server)
			startRRServer(t, p.server)
		}
	}

	// results[series][path][round]
	results := make([][][]float64, len(dpSeries))
	for k := range results {
		results[k] = make([][]float64, len(paths))
	}
	ratio := func(k, a, b, r int) float64 { return results[k][a][r] / results[k][b][r] }
	for r := 0; r < cfg.rounds; r++ {
		for _, kind := range dpKinds {
			for pi, p := range paths {
				var v []float64
				if kind.streams > 0 {
					v = runIperf(ctx, t, p, kind.streams, cfg.seconds)
				} else {
					v = runRR(ctx, t, p, cfg.seconds)
				}
				for i, k := range kind.series {
					results[k][pi] = append(results[k][pi], v[i])
				}
			}
			for _, k := range kind.series {
				line := fmt.Sprintf("round %d  %-38s", r+1, dpSeries[k].name)
				for pi, p := range paths {
					line += fmt.Sprintf("  %s %6.2f", p.name, results[k][pi][r])
				}
				line += fmt.Sprintf(" %s  overlayd/vxlan %.3f  vxlan/underlay %.3f", dpSeries[k].unit, ratio(k, 2, 1, r), ratio(k, 1, 0, r))
				if len(paths) > 3 {
					line += fmt.Sprintf("  try/vxlan %.3f  try/overlayd %.3f", ratio(k, 3, 1, r), ratio(k, 3, 2, r))
				}
				fmt.Println(line)
			}
		}
	}

	fmt.Printf("-- summary, %s underlay: median [range] over %d rounds; ratios per round\n", family, cfg.rounds)
	for k, se := range dpSeries {
		fmt.Printf("%s (%s)\n", se.name, se.unit)
		for pi, p := range paths {
			fmt.Printf("  %-22s %s\n", p.name, medianRange(results[k][pi], 2))
		}
		fmt.Printf("  %-22s %s\n", "overlayd / vxlan", medianRange(ratios(results[k][2], results[k][1]), 3))
		fmt.Printf("  %-22s %s\n", "vxlan / underlay", medianRange(ratios(results[k][1], results[k][0]), 3))
		fmt.Printf("  %-22s %s\n", "overlayd / underlay", medianRange(ratios(results[k][2], results[k][0]), 3))
		if len(paths) > 3 {
			fmt.Printf("  %-22s %s\n", "try / vxlan", medianRange(ratios(results[k][3], results[k][1]), 3))
			fmt.Printf("  %-22s %s\n", "try / overlayd", medianRange(ratios(results[k][3], results[k][2]), 3))
		}
	}
}

func ratios(a, b []float64) []float64 {
	var r []float64
	for i := range a {
		r = append(r, a[i]/b[i])
	}
	return r
}

func medianRange(v []float64, prec int) string {
	s := slices.Clone(v)
	slices.Sort(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return fmt.Sprintf("%.*f [%.*f – %.*f]", prec, med, prec, s[0], prec, s[len(s)-1])
}

// nsFile is a file of ns for a child process (nsenter --net=/proc/self/fd/3).
func nsFile(t *testing.T, ns *nstest.NS) *os.File {
	fd, err := unix.Dup(int(ns.Handle))
	if err != nil {
		t.Fatalf("dup namespace handle of %s: %v", ns.Name, err)
	}
	f := os.NewFile(uintptr(fd), ns.Name)
	t.Cleanup(func() { f.Close() })
	return f
}

// commandIn is a command run in ns. It is killed if the test process dies
// (Pdeathsig) or ctx ends.
func commandIn(ctx context.Context, t *testing.T, ns *nstest.NS, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--net=/proc/self/fd/3", "--"}, args...)...)
	cmd.ExtraFiles = []*os.File{nsFile(t, ns)}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

func startIperfServer(t *testing.T, ns *nstest.NS) {
	cmd := commandIn(context.Background(), t, ns, "iperf3", "--server", "--port", strconv.Itoa(dpIperfPort))
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatalf("iperf3 server in %s: %v", ns.Name, err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
}

// iperfResult is the part of iperf3's JSON output that the benchmark reads.
type iperfResult struct {
	Error string `json:"error"`
	End   struct {
		SumReceived struct {
			BitsPerSecond float64 `json:"bits_per_second"`
		} `json:"sum_received"`
		CPU struct {
			Host   float64 `json:"host_total"`
			Remote float64 `json:"remote_total"`
		} `json:"cpu_utilization_percent"`
	} `json:"end"`
}

// runIperf measures TCP throughput from p.client to p.addr with streams
// parallel connections: Gbit/s received, and Gbit per CPU-second of the
// client and the server. The first second (slow start) is left out.
func runIperf(ctx context.Context, t *testing.T, p dpPath, streams, seconds int) []float64 {
	var res iperfResult
	// The server may not listen yet on its first use.
	err := nstest.Eventually(10*time.Second, 100*time.Millisecond, func() error {
		out, err := commandIn(ctx, t, p.client, "iperf3", "--client", p.addr.String(), "--port", strconv.Itoa(dpIperfPort),
			"--time", strconv.Itoa(seconds), "--omit", "1", "--parallel", strconv.Itoa(streams), "--json").Output()
		if ctx.Err() != nil {
			t.Fatal("interrupted")
		}
		res = iperfResult{}
		if jerr := json.Unmarshal(out, &res); jerr != nil {
			return fmt.Errorf("iperf3 output: %v (%v): %s", jerr, err, out)
		}
		if res.Error != "" || err != nil {
			return fmt.Errorf("iperf3: %s (%v)", res.Error, err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	gbps := res.End.SumReceived.BitsPerSecond / 1e9
	return []float64{gbps, gbps / ((res.End.CPU.Host + res.End.CPU.Remote) / 100)}
}

func sockaddr(ap netip.AddrPort) (int, unix.Sockaddr) {
	if ap.Addr().Is4() {
		return unix.AF_INET, &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return unix.AF_INET6, &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

// startRRServer answers every byte it receives on port dpRRPort of ns with
// one byte, on blocking sockets (a thread per connection, as netperf's
// TCP_RR server).
func startRRServer(t *testing.T, ns *nstest.NS) {
	fd, err := netnsutil.Socket(ns.Handle, unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("request/response server in %s: %v", ns.Name, err)
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0) // IPv4 too
	_, sa := sockaddr(netip.AddrPortFrom(netip.IPv6Unspecified(), dpRRPort))
	if err := unix.Bind(fd, sa); err != nil {
		t.Fatalf("request/response server in %s: %v", ns.Name, err)
	}
	if err := unix.Listen(fd, 8); err != nil {
		t.Fatalf("request/response server in %s: %v", ns.Name, err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, _, err := unix.Accept(fd)
			if err != nil {
				if errors.Is(err, unix.EINTR) {
					continue
				}
				return // shut down
			}
			unix.SetsockoptInt(c, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
			go func() {
				defer unix.Close(c)
				b := make([]byte, 1)
				for {
					if n, err := unix.Read(c, b); n != 1 || err != nil {
						if errors.Is(err, unix.EINTR) {
							continue
						}
						return
					}
					if _, err := unix.Write(c, b); err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		unix.Shutdown(fd, unix.SHUT_RDWR) // wakes the Accept
		<-done
		unix.Close(fd)
	})
}

// runRR sends one byte and waits for the answer, again and again for
// seconds, and returns the transactions per second (in thousands) and
// their median latency in µs.
func runRR(ctx context.Context, t *testing.T, p dpPath, seconds int) []float64 {
	family, sa := sockaddr(netip.AddrPortFrom(p.addr, dpRRPort))
	fd, err := netnsutil.Socket(p.client.Handle, family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("%s: request/response client: %v", p.name, err)
	}
	defer unix.Close(fd)
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	if err := unix.Connect(fd, sa); err != nil {
		t.Fatalf("%s: request/response connect to %s: %v", p.name, p.addr, err)
	}
	b := []byte{'x'}
	lats := make([]time.Duration, 0, 200000)
	start := time.Now()
	end := start.Add(time.Duration(seconds) * time.Second)
	for now := start; now.Before(end); {
		if ctx.Err() != nil {
			t.Fatal("interrupted")
		}
		if _, err := unix.Write(fd, b); err != nil {
			t.Fatalf("%s: request/response write: %v", p.name, err)
		}
		for {
			n, err := unix.Read(fd, b)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if n != 1 || err != nil {
				t.Fatalf("%s: request/response read: %d %v", p.name, n, err)
			}
			break
		}
		next := time.Now()
		lats = append(lats, next.Sub(now))
		now = next
	}
	elapsed := time.Since(start)
	slices.Sort(lats)
	return []float64{float64(len(lats)) / elapsed.Seconds() / 1e3, float64(lats[len(lats)/2]) / 1e3}
}

// dpSettings prints what differs between the two VXLAN paths: the links'
// MTU, queue length and offloads (ethtool -k), on the hand-made VXLAN and on
// every link of overlayd's path.
func dpSettings(t *testing.T, hosts, ctrs []*nstest.NS, drivers []*Driver) {
	if os.Getenv("OVERLAYD_BENCH_SETTINGS") == "" {
		return
	}
	show := func(where string, ns *nstest.NS) {
		out, _ := commandIn(context.Background(), t, ns, "sh", "-c", "ip -d link show; for l in $(ip -o link show | sed 's/^[0-9]*: \\([^:@]*\\).*/\\1/'); do echo \"== $l\"; ethtool -k $l 2>/dev/null | grep -v fixed; done").CombinedOutput()
		fmt.Printf("---- %s\n%s", where, out)
	}
	show("host0", hosts[0])
	show("container0", ctrs[0])
	show("sandbox0", dpSandboxNS(t, drivers[0], "bench"))
}

// dpSandboxNS is the sandbox namespace of network nid on d's host.
func dpSandboxNS(t *testing.T, d *Driver, nid string) *nstest.NS {
	h, err := netnsutil.Open(d.host.Path(nid))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return &nstest.NS{Handle: h, Name: "sandbox of " + nid}
}

// dpNetwork creates network nid (VNI vni, IPv4 pool) through every
// driver (drivers[i] serves hosts[i]) with a container on each (addresses .10, .11... of the pool), tells
// every host of the others' containers, and returns the containers and the
// address of the second one.
func dpNetwork(t *testing.T, hosts []*nstest.NS, drivers []*Driver, nid string, vni int, pool string) ([]*nstest.NS, netip.Addr) {
	pfx := netip.MustParsePrefix(pool)
	var ctrs []*nstest.NS
	var peers []peerdb.Peer
	for i, d := range drivers {
		mustCreate(t, d, createReq(nid, strconv.Itoa(vni), pool))
		a := pfx.Addr()
		for j := 0; j < 10+i; j++ {
			a = a.Next()
		}
		addr := netip.PrefixFrom(a, pfx.Bits())
		eid := fmt.Sprintf("%s-ep%d", nid, i)
		mac := mustEndpoint(t, d, nid, eid, addr.String())
		resp := mustJoin(t, d, nid, eid)
		ctrs = append(ctrs, nstest.Container(t, fmt.Sprintf("%s-ctr%d", nid, i), hosts[i], resp.InterfaceName.SrcName, addr, nil))
		m, _ := peerdb.ParseMAC(mac)
		peers = append(peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: m, VTEP: d.cfg.AdvertiseAddr})
	}
	for i, d := range drivers {
		for j := range peers {
			if j != i {
				if err := applyPeerEvent(d, PeerEvent{VNI: uint32(vni), Next: &peers[j]}); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	return ctrs, peers[1].IP
}
