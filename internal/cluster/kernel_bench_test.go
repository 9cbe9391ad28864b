package cluster

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/rawnl"
	"github.com/overlayd/overlayd/internal/testutil/solo"
	"github.com/overlayd/overlayd/peerdb"
)

// BenchmarkRecordsToKernel measures the whole receiving path of a burst of
// record changes that arrive one record per message, as memberlist hands
// them over (handleMessage, one delta of one record each): decoding, the
// replica, the delivery shards, the driver's pull and its netlink writes,
// timed from the first message until the driver has programmed the last
// record (its PeersChanged returned). N = 5,120 remote peers are added
// (one message each), then deleted (one tombstone message each).
//
// The driver is never called once per record on this path: what arrives
// while it programs coalesces into its next call (delivery.go), so a
// burst costs about as much as a batch, whatever the messages' sizes.
// records/call shows the coalescing. The reference is raw netlink one
// peer per call (rawnl, one request pair and its acknowledgement each, on
// the same VXLAN link, in the same rounds): what a driver called once
// per record could reach at best. add-ratio_to_raw > 1 is faster than
// that limit.
//
// networks=32 spreads the same records over 32 networks (VNIs), which the
// cluster's delivery shards (DefaultDeliveryShards goroutines, a VNI
// always on the same one) hand to the driver in parallel; shards=1 is the
// same work delivered by one goroutine, network after network.
func BenchmarkRecordsToKernel(b *testing.B) {
	for _, c := range []struct{ nets, shards int }{{1, DefaultDeliveryShards}, {32, DefaultDeliveryShards}, {32, 1}} {
		b.Run(fmt.Sprintf("networks=%d/shards=%d", c.nets, c.shards), func(b *testing.B) { benchRecordsToKernel(b, c.nets, c.shards) })
	}
}

const (
	kernelBenchRecords = 5120
	kernelBenchVNI     = 3000
)

// kernelBenchVTEP is the origin's VTEP: the FDB entries' destination
// (nothing is sent to it).
var kernelBenchVTEP = netip.MustParseAddr("192.0.2.99")

func benchRecordsToKernel(b *testing.B, nets, shards int) {
	nstest.RequireRoot(b)
	src := &lateSource{}
	d, dir := kernelBenchDriver(b, src)
	w := &countingWatcher{d: d, done: make(chan struct{}, 1)}
	quiet := func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		c.VTEP = kernelBenchVTEP
	}
	origin := startNode(b, "kb-origin", "127.0.0.250", 0, nodeOpts{tweak: quiet})
	recv := startNode(b, "kb-recv", "127.0.0.251", 0, nodeOpts{seeds: []string{origin.addr()}, tweak: func(c *Config) {
		quiet(c)
		c.VTEP = netip.MustParseAddr("192.0.2.98")
		c.Watcher = w
		c.DeliveryShards = shards
	}})
	src.c.Store(recv.c)
	waitMembers(b, 30*time.Second, []*node{origin, recv})
	recv.c.mu.Lock()
	inc := recv.c.replica.members[origin.name].meta.Incarnation
	recv.c.mu.Unlock()

	vnis := make([]uint32, nets)
	pools := make([]netip.Prefix, nets)
	for i := range nets {
		vnis[i] = uint32(kernelBenchVNI + i)
		pools[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 18, byte(i * 4), 0}), 22)
		if nets == 1 {
			pools[i] = netip.MustParsePrefix("198.18.0.0/16")
		}
		joinBenchNetwork(b, d, fmt.Sprintf("kb%d", i), vnis[i], pools[i])
	}
	// Record i belongs to network i%nets: consecutive messages go to
	// different networks, as a busy cluster's would.
	recs := make([]record, kernelBenchRecords)
	for i := range recs {
		net := i % nets
		ip := pools[net].Addr()
		for range 10 + i/nets {
			ip = ip.Next()
		}
		recs[i] = record{VNI: vnis[net], EndpointID: fmt.Sprintf("kb-%d", i), IP: ip, MAC: peerdb.MACFromIP(ip), VTEP: kernelBenchVTEP}
	}
	// Versions far above the origin's own clock: its digests and
	// snapshots (it holds none of these records) never delete them.
	version := uint64(1) << 40
	encode := func(deleted bool) [][]byte {
		msgs := make([][]byte, len(recs))
		for i := range recs {
			version++
			r := recs[i]
			r.Version, r.Deleted = version, deleted
			m, err := encodeMessage(&message{Type: msgDelta, Origin: origin.name, Incarnation: inc, Records: []record{r}})
			if err != nil {
				b.Fatal(err)
			}
			msgs[i] = m
		}
		return msgs
	}

	ns, link := sandboxLink(b, dir, vnis[0])
	raw, err := rawnl.Open(ns, link)
	if err != nil {
		b.Fatal(err)
	}
	defer raw.Close()
	// The reference programs as many peers as the burst, one per call, on
	// network 0's link (addresses outside the networks' pools: the
	// kernel does not mind).
	rawPeers := make([]rawnl.Peer, len(recs))
	for i := range rawPeers {
		ip := netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)})
		rawPeers[i] = rawnl.Peer{IP: ip.As4(), MAC: peerdb.MACFromIP(ip), VTEP: kernelBenchVTEP.As4()}
	}

	var ours, ref [2]time.Duration
	var calls, delivered int64
	phase := func(deleted bool) time.Duration {
		msgs := encode(deleted)
		calls0, keys0 := w.calls.Load(), w.keys.Load()
		w.target.Store(keys0 + int64(len(msgs)))
		t0 := time.Now()
		for _, m := range msgs {
			recv.c.handleMessage(m)
		}
		w.wait(b)
		spent := time.Since(t0)
		calls += w.calls.Load() - calls0
		delivered += w.keys.Load() - keys0
		return spent
	}
	b.ResetTimer()
	for round := 0; round < b.N; round++ {
		overlayd := func() {
			ours[0] += phase(false)
			if round == 0 {
				b.StopTimer()
				for i := range nets {
					wantKernelPeers(b, dir, vnis[i], (len(recs)+nets-1-i)/nets)
				}
				b.StartTimer()
			}
			ours[1] += phase(true)
			if round == 0 {
				b.StopTimer()
				for i := range nets {
					wantKernelPeers(b, dir, vnis[i], 0)
				}
				b.StartTimer()
			}
		}
		reference := func() {
			for i, program := range []func([]rawnl.Peer) error{raw.Add, raw.Delete} {
				t0 := time.Now()
				for j := range rawPeers {
					if err := program(rawPeers[j : j+1]); err != nil {
						b.Fatal(err)
					}
				}
				ref[i] += time.Since(t0)
			}
		}
		if round%2 == 0 {
			overlayd()
			reference()
		} else {
			reference()
			overlayd()
		}
	}
	b.StopTimer()
	peers := float64(len(recs) * b.N)
	for i, op := range []string{"add", "del"} {
		b.ReportMetric(peers/ours[i].Seconds(), op+"-peers/s")
		b.ReportMetric(peers/ref[i].Seconds(), "raw-one-per-call-"+op+"-peers/s")
		b.ReportMetric(ref[i].Seconds()/ours[i].Seconds(), op+"-ratio_to_raw")
	}
	b.ReportMetric(float64(delivered)/float64(max(calls, 1)), "records/call")
}

// countingWatcher hands the cluster's notifications to the driver and
// counts the keys of the calls that returned (the driver has programmed
// them): wait returns once target keys were delivered.
type countingWatcher struct {
	d      *driver.Driver
	calls  atomic.Int64
	keys   atomic.Int64
	target atomic.Int64
	done   chan struct{}
}

func (w *countingWatcher) PeersChanged(vni uint32, keys []peerdb.Key) {
	w.d.PeersChanged(vni, keys)
	w.calls.Add(1)
	if w.keys.Add(int64(len(keys))) >= w.target.Load() {
		select {
		case w.done <- struct{}{}:
		default:
		}
	}
}

func (w *countingWatcher) wait(b *testing.B) {
	deadline := time.After(time.Minute)
	for w.keys.Load() < w.target.Load() {
		select {
		case <-w.done:
		case <-deadline:
			b.Fatalf("the driver was told %d keys, want %d", w.keys.Load(), w.target.Load())
		}
	}
}

// lateSource is the driver's peer source: the receiving node's cluster,
// made after the driver (which is its Watcher), as the daemon does.
type lateSource struct{ c atomic.Pointer[Cluster] }

func (s *lateSource) Peer(k peerdb.Key) (peerdb.Peer, bool) {
	if c := s.c.Load(); c != nil {
		return c.Peer(k)
	}
	return peerdb.Peer{}, false
}

func (s *lateSource) PeersOf(keys []peerdb.Key, found []peerdb.Found) {
	if c := s.c.Load(); c != nil {
		c.PeersOf(keys, found)
		return
	}
	clear(found[:len(keys)])
}

func (s *lateSource) Peers(vni uint32) map[peerdb.Key]peerdb.Peer {
	if c := s.c.Load(); c != nil {
		return c.Peers(vni)
	}
	return nil
}

// kernelBenchDriver returns a driver in a fresh host namespace, its
// sandboxes in a temporary directory (returned).
func kernelBenchDriver(b *testing.B, src driver.PeerSource) (*driver.Driver, string) {
	hosts, vteps := nstest.Hosts(b, 1, false)
	dir := nstest.NetnsDir(b)
	d, err := driver.New(driver.Config{
		HostNS:        hosts[0].Handle,
		NetnsDir:      dir,
		AdvertiseAddr: vteps[0],
		Logger:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		Peers:         src,
		// The records come from src; the rest of the control plane is a
		// host alone's.
		Publisher:   solo.ControlPlane{},
		Definitions: solo.ControlPlane{},
		Membership:  solo.ControlPlane{},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { d.Close() })
	return d, dir
}

// joinBenchNetwork creates network id with vni and pool and joins one local
// endpoint, so that it has a sandbox.
func joinBenchNetwork(b *testing.B, d *driver.Driver, id string, vni uint32, pool netip.Prefix) {
	gw := pool.Addr().Next()
	req := &api.CreateNetworkRequest{
		NetworkID: id,
		Options:   map[string]interface{}{driver.OptGeneric: map[string]interface{}{driver.OptVNI: fmt.Sprint(vni)}},
		IPv4Data:  []*api.IPAMData{{AddressSpace: "GlobalDefault", Pool: pool.String(), Gateway: netip.PrefixFrom(gw, pool.Bits()).String()}},
	}
	if err := d.CreateNetwork(req); err != nil {
		b.Fatal(err)
	}
	addr := netip.PrefixFrom(gw.Next(), pool.Bits()).String()
	if _, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: "local", Interface: &api.EndpointInterface{Address: addr}}); err != nil {
		b.Fatal(err)
	}
	if _, err := d.Join(&api.JoinRequest{NetworkID: id, EndpointID: "local", SandboxKey: "/var/run/docker/netns/bench"}); err != nil {
		b.Fatal(err)
	}
}

// sandboxLink finds the sandbox namespace (under dir) holding vni's VXLAN
// link and returns it (open until the benchmark ends) with the link's
// index.
func sandboxLink(b *testing.B, dir string, vni uint32) (ns netns.NsHandle, index int) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	for _, e := range entries {
		p := dir + "/" + e.Name()
		if !netnsutil.IsNamespace(p) {
			continue
		}
		ns, err := netnsutil.Open(p)
		if err != nil {
			continue
		}
		h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
		if err != nil {
			ns.Close()
			continue
		}
		l, err := h.LinkByName(sandbox.VXLANName(vni))
		h.Close()
		if err != nil {
			ns.Close()
			continue
		}
		b.Cleanup(func() { ns.Close() })
		return ns, l.Attrs().Index
	}
	b.Fatalf("no sandbox in %s has the VXLAN link of VNI %d", dir, vni)
	return ns, 0
}

// wantKernelPeers fails the benchmark unless vni's VXLAN link holds exactly
// n permanent neighbours and n FDB entries towards kernelBenchVTEP: the
// rates count work that was done.
func wantKernelPeers(b *testing.B, dir string, vni uint32, n int) {
	ns, link := sandboxLink(b, dir, vni)
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	neighs, err := h.NeighList(link, unix.AF_INET)
	if err != nil {
		b.Fatal(err)
	}
	fdb, err := h.NeighList(link, unix.AF_BRIDGE)
	if err != nil {
		b.Fatal(err)
	}
	perm := slices.DeleteFunc(neighs, func(n netlink.Neigh) bool { return n.State&netlink.NUD_PERMANENT == 0 })
	toVTEP := slices.DeleteFunc(fdb, func(n netlink.Neigh) bool { return !n.IP.Equal(kernelBenchVTEP.AsSlice()) })
	if len(perm) != n || len(toVTEP) != n {
		b.Fatalf("VNI %d: the kernel holds %d neighbours and %d FDB entries, want %d", vni, len(perm), len(toVTEP), n)
	}
}
