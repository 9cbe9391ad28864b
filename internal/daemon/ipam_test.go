package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	ipamapi "github.com/docker/go-plugins-helpers/ipam"

	"github.com/overlayd/overlayd/internal/pluginapi"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// blockingIPAM is a stand-in allocator whose RequestAddress waits for
// release: it tests the gate, which does not care what is behind it.
type blockingIPAM struct {
	pluginapi.IPAM // other calls are not made
	entered        chan struct{}
	release        chan struct{}
}

func (b *blockingIPAM) RequestAddress(ctx context.Context, r *ipamapi.RequestAddressRequest) (*ipamapi.RequestAddressResponse, error) {
	close(b.entered)
	<-b.release
	return &ipamapi.RequestAddressResponse{Address: "198.51.100.9/24"}, nil
}

// The address management's calls pass the plugin gate like the network
// driver's: shutdown waits for one in flight and refuses later ones, and
// the metrics see each under its IpamDriver name.
func TestIPAMCallsPassTheGate(t *testing.T) {
	var mu sync.Mutex
	var observed []string
	g := &gate{log: slog.New(slog.NewTextHandler(io.Discard, nil)), observe: func(method string, err error, _ time.Duration) {
		mu.Lock()
		observed = append(observed, fmt.Sprintf("%s:%v", method, err))
		mu.Unlock()
	}}
	inner := &blockingIPAM{entered: make(chan struct{}), release: make(chan struct{})}
	ig := ipamGate{g: g, inner: inner}
	go ig.RequestAddress(context.Background(), &ipamapi.RequestAddressRequest{PoolID: "p"})
	<-inner.entered
	closeWaits(t, g, inner.release)
	if _, err := ig.RequestPool(context.Background(), &ipamapi.RequestPoolRequest{}); err != errShuttingDown {
		t.Fatalf("IPAM call after close: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(observed) != 1 || observed[0] != "IpamDriver.RequestAddress:<nil>" {
		t.Fatalf("observed %v, want the one IpamDriver.RequestAddress", observed)
	}
}

// TestIPAMOverHTTP drives the address management through the plugin
// socket as dockerd does for `docker network create --ipam-driver overlayd
// --subnet 198.51.100.0/24` and a container, on a single daemon (the first
// host of a cluster: no seeds), with the real allocator and state file.
func TestIPAMOverHTTP(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t, "host")
	lo, err := host.NL.LinkByName("lo")
	if err == nil {
		err = host.NL.LinkSetUp(lo)
	}
	if err != nil {
		t.Fatal(err)
	}
	// The control plane (gossip on loopback, alone: no seeds) must run:
	// a pool's ring is agreed with the cluster.
	c, stop := startDaemonIn(t, "local", t.TempDir(), nstest.NetnsDir(t), host, "--advertise-addr", "127.0.0.1")
	code, out := post(t, c, "IpamDriver.GetCapabilities", "null")
	if code != 200 || out["RequiresMACAddress"] != true {
		t.Fatalf("GetCapabilities: %d %v", code, out)
	}
	if _, ok := out["RequiresRequestReplay"].(bool); !ok {
		t.Fatalf("GetCapabilities lacks RequiresRequestReplay: %v", out)
	}
	code, out = post(t, c, "IpamDriver.GetDefaultAddressSpaces", "null")
	if code != 200 || out["LocalDefaultAddressSpace"] == "" || out["LocalDefaultAddressSpace"] != out["GlobalDefaultAddressSpace"] {
		t.Fatalf("GetDefaultAddressSpaces: %d %v", code, out)
	}
	space := fmt.Sprint(out["LocalDefaultAddressSpace"])
	// Until the control plane has started, RequestPool is refused (it
	// says so); it starts within a moment.
	if err := nstest.Eventually(10*time.Second, 50*time.Millisecond, func() error {
		code, out = post(t, c, "IpamDriver.RequestPool", `{"AddressSpace":"`+space+`","Pool":"198.51.100.0/24","SubPool":"","Options":{},"V6":false}`)
		if code != 200 || out["Pool"] != "198.51.100.0/24" {
			return fmt.Errorf("RequestPool: %d %v", code, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	pool := fmt.Sprint(out["PoolID"])
	data, _ := out["Data"].(map[string]any)
	if data[gatewayKey] != "198.51.100.1/24" {
		t.Fatalf("RequestPool's Data %v: want the gateway 198.51.100.1/24 under %s", data, gatewayKey)
	}
	code, out = post(t, c, "IpamDriver.RequestAddress", `{"PoolID":"`+pool+`","Address":"","Options":{"RequestAddressType":"com.docker.network.gateway"}}`)
	if code != 200 || out["Address"] != "198.51.100.1/24" {
		t.Fatalf("gateway RequestAddress: %d %v", code, out)
	}
	code, out = post(t, c, "IpamDriver.RequestAddress", `{"PoolID":"`+pool+`","Address":"","Options":{"com.docker.network.endpoint.macaddress":"02:42:c6:33:64:09"}}`)
	addr, err := netip.ParsePrefix(fmt.Sprint(out["Address"]))
	if code != 200 || err != nil || addr.Bits() != 24 || !netip.MustParsePrefix("198.51.100.0/24").Contains(addr.Addr()) ||
		addr.Addr() == netip.MustParseAddr("198.51.100.1") || addr.Addr() == netip.MustParseAddr("198.51.100.0") {
		t.Fatalf("RequestAddress: %d %v (want an address of the pool other than network and gateway, /24)", code, out)
	}
	// The same address again for another MAC: refused, saying why.
	code, out = post(t, c, "IpamDriver.RequestAddress", `{"PoolID":"`+pool+`","Address":"`+addr.Addr().String()+`","Options":{"com.docker.network.endpoint.macaddress":"02:42:c6:33:64:0a"}}`)
	if code != 500 || !strings.Contains(fmt.Sprint(out["Err"]), addr.Addr().String()) {
		t.Fatalf("a taken address requested again: %d %v", code, out)
	}
	// Malformed: the error names the call.
	code, out = post(t, c, "IpamDriver.RequestAddress", `{"PoolID":`)
	if code != 500 || !strings.Contains(fmt.Sprint(out["Err"]), "IpamDriver.RequestAddress") {
		t.Fatalf("malformed RequestAddress: %d %v", code, out)
	}
	for _, s := range []struct{ method, body string }{
		{"IpamDriver.ReleaseAddress", `{"PoolID":"` + pool + `","Address":"` + addr.Addr().String() + `"}`},
		{"IpamDriver.ReleasePool", `{"PoolID":"` + pool + `"}`},
	} {
		if code, out := post(t, c, s.method, s.body); code != 200 {
			t.Fatalf("%s: %d %v", s.method, code, out)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}
