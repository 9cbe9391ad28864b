package daemon

import (
	"bytes"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/ipam"
)

// The text status lists networks by VNI (VNI first, in VNI order), shows
// the records this node publishes, and marks a failed member's records,
// kept in force under FailedGrace, as stale, on the member and on each of
// its peers.
func TestStatusRender(t *testing.T) {
	until := time.Date(2026, 12, 3, 1, 2, 3, 0, time.UTC)
	r := &StatusReport{
		Cluster: &cluster.Status{
			Node: cluster.NodeStatus{Name: "h1", VTEP: netip.MustParseAddr("192.0.2.1")},
			Members: []cluster.MemberStatus{
				{Name: "h1", State: cluster.StateAlive, VTEP: netip.MustParseAddr("192.0.2.1"), Records: 2, Self: true},
				{Name: "h2", State: cluster.StateDead, VTEP: netip.MustParseAddr("192.0.2.2"), Records: 1, InForceUntil: until},
				{Name: "h3", State: cluster.StateAlive, VTEP: netip.MustParseAddr("192.0.2.3"), Records: 1},
			},
		},
		Driver: driver.Status{Scope: "local", VXLANPort: 4799, AdvertiseAddr: "192.0.2.1", VTEPSource: "configured", Networks: []driver.NetworkStatus{
			{ID: "bbbbbbbbbbbbbbbbbbbb", VNIs: []uint32{5020}, Subnets: []string{"198.51.100.0/24"}, MTU: 1450, Encrypted: true},
			{ID: "aaaaaaaaaaaaaaaaaaaa", VNIs: []uint32{5019}, Subnets: []string{"203.0.113.0/24"}, MTU: 1450,
				Endpoints: []driver.EndpointStatus{{ID: "e1", Address: "203.0.113.2/24", MAC: "02:42:cb:00:71:02", Joined: true}},
				RemotePeers: []driver.PeerStatus{
					{EndpointID: "e2", IP: "203.0.113.3", MAC: "02:42:cb:00:71:03", VTEP: "192.0.2.2", Active: true},
					{EndpointID: "e3", IP: "203.0.113.4", MAC: "02:42:cb:00:71:04", VTEP: "192.0.2.3", Active: true},
				}},
		}},
	}
	var b bytes.Buffer
	r.Render(&b)
	out := b.String()
	t.Logf("\n%s", out)
	i19, i20 := strings.Index(out, "\nVNI 5019  network aaaaaaaaaaaa"), strings.Index(out, "\nVNI 5020  network bbbbbbbbbbbb")
	if i19 < 0 || i20 < 0 || i19 > i20 {
		t.Errorf("networks not listed VNI first in VNI order (5019 at %d, 5020 at %d)", i19, i20)
	}
	if !strings.Contains(out, "records published 2") {
		t.Error("the node's own record count is missing")
	}
	if l := line(out, "  h2 "); !strings.Contains(l, "stale: kept in force for its return until 01:02:03 UTC") {
		t.Errorf("failed member line %q not marked stale", l)
	}
	if l := line(out, "  h3 "); strings.Contains(l, "stale") {
		t.Errorf("alive member line %q marked stale", l)
	}
	if l := line(out, "203.0.113.3"); !strings.Contains(l, "stale") {
		t.Errorf("peer of the failed member %q not marked stale", l)
	}
	if l := line(out, "203.0.113.4"); strings.Contains(l, "stale") {
		t.Errorf("peer of an alive member %q marked stale", l)
	}
	if !strings.Contains(line(out, "VNI 5020"), "encrypted") {
		t.Error("encrypted network not marked")
	}
}

// Before the control plane starts, status says so instead of nothing, and
// an unknown VTEP reads "unknown yet", not an empty address.
func TestStatusRenderBeforeStart(t *testing.T) {
	var b bytes.Buffer
	(&StatusReport{Driver: driver.Status{Scope: "global", VXLANPort: 4799, VTEPSource: "unknown"}}).Render(&b)
	out := b.String()
	if !strings.Contains(out, "Control plane: not started") || !strings.Contains(out, "VTEP unknown yet (unknown)") {
		t.Errorf("status before the start:\n%s", out)
	}
}

func line(out, s string) string {
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}

// Readiness is the first line of the status, as /readyz says it, and a
// control plane that has not started (or has left) is not ready, with why.
func TestReadiness(t *testing.T) {
	var b bytes.Buffer
	(&StatusReport{Ready: readiness(errors.New("no reconcile has completed since the control plane started"))}).Render(&b)
	if first, _, _ := strings.Cut(b.String(), "\n"); first != "Readiness: not ready: no reconcile has completed since the control plane started" {
		t.Errorf("first line %q", first)
	}
	cp := &controlPlane{link: &clusterLink{}}
	if err := cp.ready(); err == nil || !strings.Contains(err.Error(), "has not started") {
		t.Errorf("not started: %v", err)
	}
	cp.link.hasLeft.Store(true)
	if err := cp.ready(); err == nil || !strings.Contains(err.Error(), "left the cluster") {
		t.Errorf("left: %v", err)
	}
}

// The address management's section shows, per pool, the gateway, this
// host's ranges with free/used counts, the cluster's totals with every
// owner's share (marking figures never reported), conflicts and a pending
// claim.
func TestStatusRenderIPAM(t *testing.T) {
	at := time.Date(2026, 12, 3, 4, 5, 6, 0, time.UTC)
	r := &StatusReport{Driver: driver.Status{Scope: "local"}, IPAM: &ipam.Status{
		Node: "h1", HostID: "5f3a9c0d1e2b4a68", Reclaimed: []string{"h9/0123456789abcdef"}, DroppedMessages: 3,
		Pools: []ipam.PoolStatus{{
			PoolID: "overlayd:198.51.100.0/24", Prefix: "198.51.100.0/24", Range: "198.51.100.0/24", Gateway: "198.51.100.1",
			InUse: 1, Size: 253,
			Ranges:     []ipam.RangeStatus{{First: "198.51.100.2", Last: "198.51.100.85", Size: 84, Free: 64, Used: 20}},
			LocalOwned: 84, LocalFree: 64, LocalUsed: 20,
			Owners: []ipam.OwnerStatus{
				{Node: "h1", HostID: "5f3a9c0d1e2b4a68", Owned: 84, Reported: true, Free: 64, Used: 20, State: "self"},
				{Node: "h2", HostID: "77", Owned: 85, Reported: true, Free: 75, Used: 10, Since: at, State: "alive"},
				{Node: "h3", HostID: "88", Owned: 84, State: "dead"},
			},
			ClusterFree: 139, ClusterUsed: 30, Unreported: 84,
			Conflicts:    []string{"198.51.100.90 allocated here in a range owned by h2"},
			PendingClaim: "voted for h2's claim, awaiting its commit",
		}},
	}}
	var b bytes.Buffer
	r.Render(&b)
	out := b.String()
	t.Logf("\n%s", out)
	for _, want := range []string{
		"Address management (--ipam-driver overlayd): host id 5f3a9c0d1e2b4a68, 1 pool(s)",
		"reclaimed identity h9/0123456789abcdef",
		"messages dropped on a full queue: 3",
		"pool 198.51.100.0/24  gateway 198.51.100.1  range 198.51.100.0/24  253 addresses; used by 1 network(s) here",
		"this host owns 84: 64 free, 20 used",
		"198.51.100.2-198.51.100.85  84 addresses: 64 free, 20 used",
		"cluster: 139 free, 30 used, 84 owned by hosts that have not reported",
		"pending claim: voted for h2's claim, awaiting its commit",
		"CONFLICT: 198.51.100.90 allocated here in a range owned by h2",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("IPAM status lacks %q", want)
		}
	}
	if l := line(out, "      h2 "); !strings.Contains(l, "alive") || !strings.Contains(l, "owns 85: 75 free, 10 used as of 04:05:06 UTC") {
		t.Errorf("owner line %q", l)
	}
	if l := line(out, "      h3 "); !strings.Contains(l, "dead") || !strings.Contains(l, "owns 84: not reported") {
		t.Errorf("unreported owner line %q", l)
	}
	// The text lists the pools after the encryption and before the
	// networks.
	if strings.Index(out, "Address management") > strings.Index(out, "\nDriver:") {
		t.Error("the IPAM section comes after the driver's")
	}
}

// A network with IPv6 shows its subnets of both families, each endpoint's
// addresses, and each remote peer's addresses with the state of each claim.
func TestStatusRenderIPv6(t *testing.T) {
	r := &StatusReport{Driver: driver.Status{Scope: "local", Networks: []driver.NetworkStatus{
		{ID: "cccccccccccccccccccc", VNIs: []uint32{5030}, Subnets: []string{"198.51.100.0/24", "2001:db8:1::/64"}, MTU: 1450,
			Endpoints: []driver.EndpointStatus{
				{ID: "e1", Address: "198.51.100.2/24", AddressIPv6: "2001:db8:1::2/64", MAC: "02:00:00:00:00:01", Joined: true},
				{ID: "e2", AddressIPv6: "2001:db8:1::5/64", MAC: "02:00:00:00:00:05", Joined: true},
			},
			RemotePeers: []driver.PeerStatus{
				{EndpointID: "e3", IP: "198.51.100.3", IPv6: "2001:db8:1::3", MAC: "02:00:00:00:00:03", VTEP: "192.0.2.2", Active: true},
				{EndpointID: "e4", IPv6: "2001:db8:1::4", MAC: "02:00:00:00:00:04", VTEP: "192.0.2.3"},
			}},
	}}}
	var b bytes.Buffer
	r.Render(&b)
	out := b.String()
	t.Logf("\n%s", out)
	for _, tc := range []struct{ line, want string }{
		{"VNI 5030", "subnets 198.51.100.0/24,2001:db8:1::/64"},
		{"local  198.51.100.2/24", "198.51.100.2/24,2001:db8:1::2/64"},
		{"2001:db8:1::5/64", "joined"},
		{"remote 198.51.100.3", "198.51.100.3,2001:db8:1::3 02:00:00:00:00:03  via 192.0.2.2       active,shadowed"},
		{"remote 2001:db8:1::4", "shadowed e4"},
	} {
		if l := line(out, tc.line); !strings.Contains(l, tc.want) {
			t.Errorf("line %q does not say %q", l, tc.want)
		}
	}
}
