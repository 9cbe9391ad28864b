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
	cp := &controlPlane{}
	if err := cp.ready(); err == nil || !strings.Contains(err.Error(), "has not started") {
		t.Errorf("not started: %v", err)
	}
	cp.hasLeft.Store(true)
	if err := cp.ready(); err == nil || !strings.Contains(err.Error(), "left the cluster") {
		t.Errorf("left: %v", err)
	}
}
