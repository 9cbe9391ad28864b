package guest

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// TestDaemonEncryptedDualStackVM (issue 12): two whole daemons, an
// encrypted dual-stack network (one IPv4 and one IPv6 subnet on one VNI),
// one container per host with both addresses. Containers ping each other
// over IPv4 and over IPv6; the underlay carries ESP only: no clear-text
// VXLAN of the network's VNI, whatever the inner family, and a burst of
// IPv6-only pings raises the ESP count on both hosts (so IPv6 crossed, and
// crossed encrypted).
func TestDaemonEncryptedDualStackVM(t *testing.T) {
	requireESP(t)
	nss, vteps := nstest.Hosts(t, 2, false)
	keyFile := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(keyFile, []byte("0123456789abcdef0123456789abcdef"), 0o600); err != nil {
		t.Fatal(err)
	}
	const vni = 4310
	var hs [2]*daemonHost
	for i := range hs {
		hs[i] = startDaemonHost(t, fmt.Sprintf("vm6-host%d", i), nss[i], vteps[i], vteps[1-i], keyFile)
	}
	v4 := []netip.Prefix{netip.MustParsePrefix("203.0.113.10/24"), netip.MustParsePrefix("203.0.113.11/24")}
	v6 := []netip.Prefix{netip.MustParsePrefix("2001:db8:1::10/64"), netip.MustParsePrefix("2001:db8:1::11/64")}
	var ctrs [2]*nstest.NS
	for i, h := range hs {
		h.call(t, "CreateNetwork", map[string]any{"NetworkID": "enc6",
			"Options": map[string]any{
				"com.docker.network.enable_ipv6": true,
				"com.docker.network.generic":     map[string]string{"vni": fmt.Sprint(vni), "encrypted": ""},
			},
			"IPv4Data": []map[string]string{{"Pool": "203.0.113.0/24", "Gateway": "203.0.113.1/24"}},
			"IPv6Data": []map[string]string{{"Pool": "2001:db8:1::/64", "Gateway": "2001:db8:1::1/64"}}})
		eid := fmt.Sprintf("ep%d", i)
		h.call(t, "CreateEndpoint", map[string]any{"NetworkID": "enc6", "EndpointID": eid,
			"Interface": map[string]string{"Address": v4[i].String(), "AddressIPv6": v6[i].String()}})
		resp := h.call(t, "Join", map[string]any{"NetworkID": "enc6", "EndpointID": eid, "SandboxKey": "/none"})
		if gw, _ := resp["GatewayIPv6"].(string); gw != "2001:db8:1::1" {
			t.Errorf("host %d: Join returned GatewayIPv6 %q, want 2001:db8:1::1", i, gw)
		}
		ctrs[i] = nstest.Container(t, eid, nss[i], resp["InterfaceName"].(map[string]any)["SrcName"].(string), v4[i], nil)
		addAddr6(t, ctrs[i], v6[i])
	}
	capts := [2]*nstest.Capture{nstest.StartCapture(t, nss[0], "eth0", vxlanPort), nstest.StartCapture(t, nss[1], "eth0", vxlanPort)}
	for i := range ctrs {
		if err := nstest.PingEventually(ctrs[i], v4[1-i].Addr(), 30*time.Second); err != nil {
			t.Fatalf("container %d: no IPv4 ping through the encrypted dual-stack network: %v", i, err)
		}
		if err := nstest.Eventually(30*time.Second, 0, func() error { return nstest.Ping(ctrs[i], v6[1-i].Addr(), 200*time.Millisecond) }); err != nil {
			t.Fatalf("container %d: no IPv6 ping through the encrypted dual-stack network: %v", i, err)
		}
	}
	// IPv6 alone: every echo answered, and ESP on both underlays rises by
	// at least one packet per echo and reply.
	esp := [2]int64{capts[0].ESP(), capts[1].ESP()}
	const burst = 20
	for n := 0; n < burst; n++ {
		if err := nstest.Ping(ctrs[0], v6[1].Addr(), 2*time.Second); err != nil {
			t.Fatalf("IPv6 echo %d of %d: %v", n+1, burst, err)
		}
	}
	// The capture reads asynchronously: wait for it to count the burst.
	if err := nstest.Eventually(5*time.Second, 10*time.Millisecond, func() error {
		for i, c := range capts {
			if d := c.ESP() - esp[i]; d < 2*burst {
				return fmt.Errorf("host %d: %d ESP packets during %d IPv6 echoes and replies", i, d, burst)
			}
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	for i, c := range capts {
		t.Logf("FIGURE: dual-stack: host %d underlay capture: %d ESP packets, %d clear-text VXLAN packets of VNI %d", i, c.ESP(), c.ClearOf(vni), vni)
		if n := c.ClearOf(vni); n != 0 {
			t.Errorf("host %d: %d clear-text VXLAN packets of the encrypted dual-stack VNI %d on the underlay", i, n, vni)
		}
	}
}

// addAddr6 gives the container's eth0 addr (without duplicate address
// detection, as dockerd does: it would hold the address tentative for a
// second).
func addAddr6(t *testing.T, c *nstest.NS, addr netip.Prefix) {
	t.Helper()
	l, err := c.NL.LinkByName("eth0")
	if err != nil {
		t.Fatalf("container %s: eth0: %v", c.Name, err)
	}
	a := &netlink.Addr{IPNet: &net.IPNet{IP: addr.Addr().AsSlice(), Mask: net.CIDRMask(addr.Bits(), 128)}, Flags: unix.IFA_F_NODAD}
	if err := c.NL.AddrAdd(l, a); err != nil {
		t.Fatalf("container %s: address %s: %v", c.Name, addr, err)
	}
}
