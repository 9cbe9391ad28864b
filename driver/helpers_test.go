package driver

import (
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/solo"
)

// alone completes cfg's control plane as a host alone's: each interface
// it leaves unset is solo's, but Peers, a fresh memSource (tests put
// remote records there).
func alone(cfg Config) Config {
	if cfg.Peers == nil {
		cfg.Peers = newMemSource()
	}
	if cfg.Publisher == nil {
		cfg.Publisher = solo.ControlPlane{}
	}
	if cfg.Definitions == nil {
		cfg.Definitions = solo.ControlPlane{}
	}
	if cfg.Membership == nil {
		cfg.Membership = solo.ControlPlane{}
	}
	return cfg
}

func testLogger() *slog.Logger {
	if os.Getenv("OVERLAYD_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// newTestDriver returns a driver whose host namespace is host (a fresh one if
// nil) and whose sandboxes live in a temporary directory.
func newTestDriver(t testing.TB, host *nstest.NS, adv netip.Addr) *Driver {
	t.Helper()
	return newTestDriverLogging(t, host, adv, testLogger())
}

// newTestDriverLogging is newTestDriver logging to log.
func newTestDriverLogging(t testing.TB, host *nstest.NS, adv netip.Addr, log *slog.Logger) *Driver {
	t.Helper()
	if host == nil {
		host = nstest.NewNS(t, "host")
	}
	d, err := New(alone(Config{
		HostNS:        host.Handle,
		NetnsDir:      nstest.NetnsDir(t),
		AdvertiseAddr: adv,
		Logger:        log,
		Peers:         newMemSource(),
	}))
	if err != nil {
		t.Fatalf("driver.New: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// newOfflineDriver returns a driver for tests that never reach the kernel
// (validation): it still needs a host namespace for its netlink handle.
func newOfflineDriver(t testing.TB) *Driver {
	t.Helper()
	return newTestDriver(t, nil, netip.Addr{})
}

func createReq(id, vni string, pools ...string) *api.CreateNetworkRequest {
	req := &api.CreateNetworkRequest{
		NetworkID: id,
		Options: map[string]interface{}{
			OptGeneric: map[string]interface{}{},
		},
	}
	if vni != "" {
		req.Options[OptGeneric].(map[string]interface{})[OptVNI] = vni
	}
	for _, p := range pools {
		pfx := netip.MustParsePrefix(p)
		gw := pfx.Addr().Next()
		req.IPv4Data = append(req.IPv4Data, &api.IPAMData{
			AddressSpace: "GlobalDefault",
			Pool:         pfx.String(),
			Gateway:      fmt.Sprintf("%s/%d", gw, pfx.Bits()),
		})
	}
	return req
}

func mustCreate(t testing.TB, d *Driver, req *api.CreateNetworkRequest) {
	t.Helper()
	if err := d.CreateNetwork(req); err != nil {
		t.Fatalf("CreateNetwork %s: %v", req.NetworkID, err)
	}
}

func mustEndpoint(t testing.TB, d *Driver, nid, eid, addr string) string {
	t.Helper()
	resp, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: nid, EndpointID: eid, Interface: &api.EndpointInterface{Address: addr}})
	if err != nil {
		t.Fatalf("CreateEndpoint %s: %v", eid, err)
	}
	return resp.Interface.MacAddress
}

func mustJoin(t testing.TB, d *Driver, nid, eid string) *api.JoinResponse {
	t.Helper()
	resp, err := d.Join(&api.JoinRequest{NetworkID: nid, EndpointID: eid, SandboxKey: "/var/run/docker/netns/test"})
	if err != nil {
		t.Fatalf("Join %s: %v", eid, err)
	}
	return resp
}

func mustAudit(t testing.TB, d *Driver) {
	t.Helper()
	problems, err := d.Audit()
	if err != nil {
		t.Fatalf("Audit: %v", err)
	}
	if len(problems) > 0 {
		t.Fatalf("audit found %d differences between kernel and driver:\n%s", len(problems), joinLines(problems))
	}
}

func joinLines(s []string) string {
	out := ""
	for _, l := range s {
		out += "  " + l + "\n"
	}
	return out
}
