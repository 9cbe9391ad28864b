package driver

import (
	"bytes"
	"log/slog"
	"slices"
	"strings"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/solo"
)

// seedMembership is a control plane's Membership for the seed tests: its
// gossip seeds are gossip's answer, and seeds handed to it are added to
// added.
type seedMembership struct {
	solo.ControlPlane
	gossip func() []string
	added  [][]string
}

func (m *seedMembership) GossipSeeds() []string {
	if m.gossip == nil {
		return nil
	}
	return m.gossip()
}

func (m *seedMembership) AddSeeds(seeds []string) { m.added = append(m.added, slices.Clone(seeds)) }

// newSwarmDriver returns a driver in a fresh namespace with cfg's swarm
// membership, logging into log (if not nil).
func newSwarmDriver(t *testing.T, cfg Config, log *bytes.Buffer) *Driver {
	t.Helper()
	host := nstest.NewNS(t, "host")
	cfg.HostNS, cfg.NetnsDir, cfg.Peers = host.Handle, nstest.NetnsDir(t), newMemSource()
	cfg.Logger = testLogger()
	if log != nil {
		cfg.Logger = slog.New(slog.NewTextHandler(log, nil))
	}
	d, err := New(alone(cfg))
	if err != nil {
		t.Fatalf("driver.New: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// The leader's AllocateNetwork answer carries its gossip seeds, so that
// nodes whose plugin starts in an existing swarm find the cluster; a
// re-send of the previous answer (leader restart) refreshes them instead
// of piling them up, and keeps them while the control plane is not up.
func TestAllocateNetworkCarriesGossipSeeds(t *testing.T) {
	seeds := []string{"192.0.2.1:7947", "192.0.2.2:7947"}
	d := newSwarmDriver(t, Config{Membership: &seedMembership{gossip: func() []string { return seeds }}}, nil)
	req := &api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: map[string]string{"foo": "bar"},
		IPv4Data: []api.IPAMData{{Pool: "198.51.100.0/24"}}}
	resp, err := d.AllocateNetwork(req)
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Options[OptSeeds]; got != "192.0.2.1:7947,192.0.2.2:7947" {
		t.Fatalf("AllocateNetwork options %v: want %s=192.0.2.1:7947,192.0.2.2:7947", resp.Options, OptSeeds)
	}
	// The leader restarted and knows other members now: its previous
	// answer comes back as input; the seeds are the fresh ones only.
	seeds = []string{"192.0.2.1:7947", "192.0.2.3:7947"}
	again, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: resp.Options, IPv4Data: req.IPv4Data})
	if err != nil {
		t.Fatal(err)
	}
	if again.Options[OptSeeds] != "192.0.2.1:7947,192.0.2.3:7947" || again.Options[OptVNI] != resp.Options[OptVNI] || again.Options["foo"] != "bar" {
		t.Fatalf("re-sent AllocateNetwork: options %v, want the fresh seeds, vni %s and foo=bar", again.Options, resp.Options[OptVNI])
	}
	// No control plane yet: the seeds the network carried are kept.
	seeds = nil
	kept, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: again.Options, IPv4Data: req.IPv4Data})
	if err != nil || kept.Options[OptSeeds] != "192.0.2.1:7947,192.0.2.3:7947" {
		t.Fatalf("re-sent AllocateNetwork without a control plane: %v %v; want the seeds kept", kept, err)
	}
	// ... and a new network carries none rather than a made-up one.
	none, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet2", IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}})
	if _, ok := none.Options[OptSeeds]; err != nil || ok {
		t.Fatalf("AllocateNetwork without a control plane: %v %v; want no %s", none, err, OptSeeds)
	}
	// Seeds given by hand are checked like any option.
	_, err = d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet3", IPv4Data: []api.IPAMData{{Pool: "203.0.113.0/24"}},
		Options: map[string]string{OptSeeds: "192.0.2.1:7947,nohost"}})
	if err == nil || !strings.Contains(err.Error(), OptSeeds) || !strings.Contains(err.Error(), `"nohost"`) {
		t.Fatalf("AllocateNetwork with a bad %s: %v; want an error naming the option and the entry", OptSeeds, err)
	}
}

// A node's CreateNetwork hands the seeds the network carries to the
// control plane, once the network exists; a bad value is refused with the
// option's name and nothing is created; a restored network hands its
// seeds again, so a restarted plugin finds the cluster.
func TestCreateNetworkHandsSeeds(t *testing.T) {
	m := &seedMembership{}
	dir := t.TempDir()
	cfg := Config{Membership: m, StateFile: openStore(t, dir)}
	host := nstest.NewNS(t, "host")
	cfg.HostNS, cfg.NetnsDir, cfg.Logger = host.Handle, nstest.NetnsDir(t), testLogger()
	d, err := New(alone(cfg))
	if err != nil {
		t.Fatalf("driver.New: %v", err)
	}

	bad := createReq("n1", "4242", "198.51.100.0/24")
	bad.Options[OptGeneric].(map[string]interface{})[OptSeeds] = "192.0.2.1"
	if err := d.CreateNetwork(bad); err == nil || !strings.Contains(err.Error(), OptSeeds) || !strings.Contains(err.Error(), "port in 1..65535") {
		t.Fatalf("CreateNetwork with %s=192.0.2.1 (no port): %v; want an error naming the option and what is allowed", OptSeeds, err)
	}
	if len(m.added) != 0 || len(d.Status().Networks) != 0 {
		t.Fatalf("refused CreateNetwork: seeds handed %v, networks %v; want none", m.added, d.Status().Networks)
	}

	req := createReq("n1", "4242", "198.51.100.0/24")
	req.Options[OptGeneric].(map[string]interface{})[OptSeeds] = "192.0.2.1:7947, 192.0.2.2:17947"
	mustCreate(t, d, req)
	mustCreate(t, d, createReq("n2", "4243", "203.0.113.0/24")) // no seeds: nothing handed
	want := []string{"192.0.2.1:7947", "192.0.2.2:17947"}
	if len(m.added) != 1 || !slices.Equal(m.added[0], want) {
		t.Fatalf("seeds handed to the control plane: %v; want once %v", m.added, want)
	}

	// The plugin restarts: the restored network hands its seeds again.
	d.Close()
	cfg.StateFile.Close()
	m.added = nil
	cfg.StateFile = openStore(t, dir)
	t.Cleanup(func() { cfg.StateFile.Close() })
	d, err = New(alone(cfg))
	if err != nil {
		t.Fatalf("driver.New on the saved state: %v", err)
	}
	d.Close()
	if len(m.added) != 1 || !slices.Equal(m.added[0], want) {
		t.Fatalf("seeds handed by the restored networks: %v; want once %v", m.added, want)
	}
}

// Swarm services on an overlayd network need --endpoint-mode dnsrr: the
// leader says so once per network, at its first allocation, not at every
// re-send.
func TestAllocateNetworkWarnsDNSRROnce(t *testing.T) {
	var log bytes.Buffer
	d := newSwarmDriver(t, Config{}, &log)
	req := &api.AllocateNetworkRequest{NetworkID: "swarmnet1", IPv4Data: []api.IPAMData{{Pool: "198.51.100.0/24"}}}
	resp, err := d.AllocateNetwork(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: resp.Options, IPv4Data: req.IPv4Data}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet2", IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}}); err != nil {
		t.Fatal(err)
	}
	var warns []string
	for _, l := range strings.Split(log.String(), "\n") {
		if strings.Contains(l, "level=WARN") && strings.Contains(l, "--endpoint-mode dnsrr") {
			warns = append(warns, l)
		}
	}
	if len(warns) != 2 || !strings.Contains(warns[0], "network=swarmnet1") || !strings.Contains(warns[1], "network=swarmnet2") ||
		!strings.Contains(warns[0], "built-in overlay driver") {
		t.Fatalf("dnsrr warnings: %q; want one per network (swarmnet1, swarmnet2) saying why\nlog:\n%s", warns, log.String())
	}
}
