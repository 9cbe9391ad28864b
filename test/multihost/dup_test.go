package multihost

import (
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// Two hosts hand out the same address (two engines with the same
// --subnet) and the remote duplicate pings a container on the other host
// continuously: the two containers on that host keep every one of 20 pings
// between them, and both hosts log the conflict at WARN and count it in
// their status. On a bridge port that learns, the duplicate's frames move
// the local MAC to the tunnel (with IP-derived MACs the two share one).
func TestDuplicateAddressAcrossHosts(t *testing.T) {
	nstest.RequireRoot(t)
	hosts := startCluster(t, 2)
	dupAddr := netip.MustParsePrefix("198.51.100.10/24")
	otherAddr := netip.MustParsePrefix("198.51.100.11/24")
	c1 := hosts[0].join(t, "c1", dupAddr)
	c2 := hosts[0].join(t, "c2", otherAddr)
	dup := hosts[1].join(t, "dup", dupAddr)

	// host1 knows c2 (so the duplicate's pings cross to host0) and each
	// host knows the other's claim of the duplicate address.
	if err := nstest.Eventually(15*time.Second, 50*time.Millisecond, func() error {
		for _, h := range hosts {
			st := h.status(t)
			nets, _ := st["driver"].(map[string]any)["networks"].([]any)
			if len(nets) != 1 || len(nets[0].(map[string]any)["conflicts"].([]any)) != 1 {
				return fmt.Errorf("%s does not see the conflict yet", h.name)
			}
		}
		if n, _ := hosts[1].neighbours(t); n[otherAddr.Addr().String()] == "" {
			return fmt.Errorf("host1 has no neighbour for c2 yet")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	// The duplicate pings c2 as fast as it can (its replies go to c1 on
	// host0, so each waits out its timeout).
	loop := nstest.StartPingLoop(dup, otherAddr.Addr(), 0, 20*time.Millisecond)
	stop := sync.OnceValues(loop.Stop)
	defer stop()
	// dupFrame waits until another frame from the duplicate reached host0.
	rx := hosts[0].vxlanRx(t)
	dupFrame := func() {
		t.Helper()
		if err := nstest.Eventually(5*time.Second, time.Millisecond, func() error {
			now := hosts[0].vxlanRx(t)
			if now == rx {
				return fmt.Errorf("no frame from the duplicate reached host0's VXLAN")
			}
			rx = now
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}

	// 20 pings each way between the two containers on host0, each after a
	// frame of the duplicate arrived. c2 pings first: it never sends from
	// c1's MAC, so only the bridge's entry brings its frames to c1.
	lost := 0
	for range 20 {
		dupFrame()
		if nstest.Ping(c2, dupAddr.Addr(), time.Second) != nil {
			lost++
		}
		dupFrame()
		if nstest.Ping(c1, otherAddr.Addr(), time.Second) != nil {
			lost++
		}
	}
	sent, _ := stop()
	t.Logf("c1 ↔ c2 on host0: %d of 40 pings lost while the duplicate on host1 sent %d pings", lost, sent)
	if lost != 0 {
		t.Fatalf("the containers on host0 lost %d of 40 pings to the remote duplicate's traffic", lost)
	}

	// Both hosts log the conflict once at WARN (the reconcile finds it
	// within its 5 s tick), naming network, VNI, address and both hosts,
	// and count it.
	for i, h := range hosts {
		other := hosts[1-i]
		want := []string{"level=WARN", `msg="address conflict:`, "network=" + netID, fmt.Sprintf("vni=%d", vni),
			"address=" + dupAddr.Addr().String(), fmt.Sprintf(`winner_host="this host (%s)"`, h.vtep),
			fmt.Sprintf(`other_hosts="%s (%s)"`, other.name, other.vtep)}
		var lines []string
		if err := nstest.Eventually(15*time.Second, 100*time.Millisecond, func() error {
			lines = nil
			for _, l := range strings.Split(h.logs.String(), "\n") {
				if strings.Contains(l, `msg="address conflict:`) {
					lines = append(lines, l)
				}
			}
			if len(lines) == 0 {
				return fmt.Errorf("%s has not logged the conflict", h.name)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if len(lines) != 1 {
			t.Fatalf("%s logged the conflict %d times, want once:\n%s", h.name, len(lines), strings.Join(lines, "\n"))
		}
		for _, w := range want {
			if !strings.Contains(lines[0], w) {
				t.Errorf("%s's conflict line lacks %s:\n%s", h.name, w, lines[0])
			}
		}
		nets, _ := h.status(t)["driver"].(map[string]any)["networks"].([]any)
		if seen := nets[0].(map[string]any)["conflicts_seen"]; seen != float64(1) {
			t.Errorf("%s status: conflicts_seen %v, want 1", h.name, seen)
		}
	}
}

// vxlanRx returns how many frames the network's VXLAN link on h received.
func (h *host) vxlanRx(t *testing.T) uint64 {
	t.Helper()
	nl, vx := h.vxlan(t)
	nl.Close()
	return vx.Attrs().Statistics.RxPackets
}
