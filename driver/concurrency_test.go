package driver

import (
	"fmt"
	"math/rand"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// 32 goroutines create and delete the same network ids and create, join,
// leave and delete endpoints, and inject remote peers, all at once; then
// the audit must show the kernel holding exactly what the driver believes.
// (The full seeded stress harness with an oracle is a separate suite.)
func TestConcurrencySmoke(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	const workers = 32
	iters := 100
	if testing.Short() {
		iters = 15
	}
	nets := []struct {
		id, vni, pool string
		vniN          uint32
	}{{"smoke-a", "10", "198.51.100.0/24", 10}, {"smoke-b", "11", "203.0.113.0/24", 11}}
	var wg sync.WaitGroup
	var joins, peers atomic.Int64
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(w)))
			for i := 0; i < iters; i++ {
				n := nets[w%len(nets)]
				pfx := netip.MustParsePrefix(n.pool)
				ip := pfx.Addr().As4()
				ip[3] = byte(10 + w)
				eid := fmt.Sprintf("ep%d", w)
				addr := netip.PrefixFrom(netip.AddrFrom4(ip), 24).String()
				switch op := rng.Intn(100); {
				case op < 4:
					d.CreateNetwork(createReq(n.id, n.vni, n.pool))
				case op < 5:
					d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: n.id})
				case op < 30:
					d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: n.id, EndpointID: eid, Interface: &api.EndpointInterface{Address: addr}})
				case op < 60:
					if _, err := d.Join(&api.JoinRequest{NetworkID: n.id, EndpointID: eid}); err == nil {
						joins.Add(1)
					}
				case op < 70:
					d.Leave(&api.LeaveRequest{NetworkID: n.id, EndpointID: eid})
				case op < 75:
					d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: n.id, EndpointID: eid})
				default:
					rip := pfx.Addr().As4()
					rip[3] = byte(100 + rng.Intn(20))
					p := peerdb.Peer{EndpointID: fmt.Sprintf("r%d", rip[3]), IP: netip.AddrFrom4(rip),
						MAC: peerdb.MAC{2, 9, 0, 0, byte(w), rip[3]}, VTEP: netip.AddrFrom4([4]byte{192, 0, 2, byte(50 + rng.Intn(4))})}
					if op < 90 {
						if applyPeerEvent(d, PeerEvent{VNI: n.vniN, Next: &p}) == nil {
							peers.Add(1)
						}
					} else {
						applyPeerEvent(d, PeerEvent{VNI: n.vniN, Prev: &p})
					}
				}
			}
		}(w)
	}
	wg.Wait()
	t.Logf("%d successful joins, %d peer adds", joins.Load(), peers.Load())
	if joins.Load() < workers/2 {
		t.Fatalf("only %d joins succeeded: the workload does not exercise the sandbox", joins.Load())
	}
	mustAudit(t, d)
	for _, n := range nets {
		if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: n.id}); err != nil {
			t.Fatal(err)
		}
	}
	assertNothingLeft(t, d, hosts[0])
}
