package metrics

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/ipam"
)

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(body)
}

// /readyz answers what Sources.Ready says, with the reason when not
// ready; /healthz is 200 regardless; overlayd_ready agrees.
func TestHealthEndpoints(t *testing.T) {
	var notReady error = errors.New("the control plane has not joined the cluster yet")
	m := New(Sources{Ready: func() error { return notReady }})
	h := m.Handler()
	if code, body := get(t, h, "/healthz"); code != 200 || body != "ok\n" {
		t.Errorf("/healthz: %d %q", code, body)
	}
	if code, body := get(t, h, "/readyz"); code != 503 || !strings.Contains(body, "has not joined") {
		t.Errorf("/readyz when not ready: %d %q, want 503 with the reason", code, body)
	}
	if text := scrapeText(t, m); !strings.Contains(text, "\noverlayd_ready 0\n") {
		t.Errorf("overlayd_ready is not 0 when not ready:\n%s", text)
	}
	notReady = nil
	if code, body := get(t, h, "/readyz"); code != 200 || body != "ready\n" {
		t.Errorf("/readyz when ready: %d %q", code, body)
	}
	if text := scrapeText(t, m); !strings.Contains(text, "\noverlayd_ready 1\n") {
		t.Errorf("overlayd_ready is not 1 when ready")
	}
}

// Each Metrics has its own registry: two in one process do not collide,
// and a call counted in one is not in the other.
func TestRegistriesArePrivate(t *testing.T) {
	a, b := New(Sources{}), New(Sources{})
	a.ObserveCall("Join", nil, time.Millisecond)
	a.ObserveCall("Join", errors.New("no such endpoint"), time.Millisecond)
	ta, tb := scrapeText(t, a), scrapeText(t, b)
	for _, want := range []string{
		`overlayd_plugin_calls_total{method="Join",outcome="ok"} 1`,
		`overlayd_plugin_calls_total{method="Join",outcome="error"} 1`,
		`overlayd_plugin_call_duration_seconds_count{method="Join"} 2`,
	} {
		if !strings.Contains(ta, want+"\n") {
			t.Errorf("a lacks %s", want)
		}
	}
	if !strings.Contains(tb, `overlayd_plugin_calls_total{method="Join",outcome="ok"} 0`+"\n") {
		t.Errorf("b counted a's call")
	}
}

// The collector reads the owners at scrape time: per-VNI series exist from
// zero for every VNI of every network, peers split by state, members by
// state, and a control plane not started reads as overlayd_gossip_up 0.
func TestCollectorReadsOwners(t *testing.T) {
	st := driver.Status{Networks: []driver.NetworkStatus{{
		ID: "n1", VNIs: []uint32{300, 301},
		Endpoints:   []driver.EndpointStatus{{ID: "e1", VNI: 300, Joined: true}, {ID: "e2", VNI: 300}},
		RemotePeers: []driver.PeerStatus{{VNI: 300, Active: true}, {VNI: 300, Active: true}, {VNI: 300}},
		Conflicts:   []driver.ConflictStatus{{VNI: 300}},
	}}}
	var cs *cluster.Status
	m := New(Sources{Driver: func() driver.Status { return st }, Cluster: func() *cluster.Status { return cs }})
	text := scrapeText(t, m)
	for _, want := range []string{
		`overlayd_networks 1`,
		`overlayd_endpoints{state="joined",vni="300"} 1`,
		`overlayd_endpoints{state="created",vni="300"} 1`,
		`overlayd_endpoints{state="joined",vni="301"} 0`,
		`overlayd_remote_peers{state="active",vni="300"} 2`,
		`overlayd_remote_peers{state="shadowed",vni="300"} 1`,
		`overlayd_address_conflicts{vni="300"} 1`,
		`overlayd_gossip_up 0`,
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("scrape lacks %s", want)
		}
	}
	cs = &cluster.Status{Members: []cluster.MemberStatus{{State: cluster.StateAlive}, {State: cluster.StateAlive}, {State: cluster.StateDead}},
		Dropped: map[cluster.DropReason]uint64{cluster.DropGossipAuth: 4}}
	text = scrapeText(t, m)
	for _, want := range []string{
		`overlayd_gossip_up 1`,
		`overlayd_gossip_members{state="alive"} 2`,
		`overlayd_gossip_members{state="dead"} 1`,
		`overlayd_gossip_members{state="suspect"} 0`,
		`overlayd_gossip_dropped_total{reason="gossip_auth_failed"} 4`,
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

// The address management's metrics: free and used addresses of each pool
// in this host's ranges, read from its status at scrape time, and the
// refused requests by reason; its plugin calls are reported from zero
// under their own names (both APIs have a GetCapabilities).
func TestIPAMMetrics(t *testing.T) {
	st := &ipam.Status{Pools: []ipam.PoolStatus{
		{PoolID: "overlayd:198.51.100.0/24", LocalFree: 64, LocalUsed: 20},
		{PoolID: "overlayd:127.77.0.0/20", LocalFree: 4093},
	}}
	m := New(Sources{IPAM: func() *ipam.Status { return st }})
	m.ObserveIPAMRefusal("pool_full")
	m.ObserveIPAMRefusal("pool_full")
	m.ObserveIPAMRefusal("other")
	m.ObserveCall("IpamDriver.RequestAddress", nil, time.Millisecond)
	text := scrapeText(t, m)
	for _, want := range []string{
		`overlayd_ipam_addresses{pool="overlayd:198.51.100.0/24",state="free"} 64`,
		`overlayd_ipam_addresses{pool="overlayd:198.51.100.0/24",state="used"} 20`,
		`overlayd_ipam_addresses{pool="overlayd:127.77.0.0/20",state="free"} 4093`,
		`overlayd_ipam_addresses{pool="overlayd:127.77.0.0/20",state="used"} 0`,
		`overlayd_ipam_refused_total{reason="pool_full"} 2`,
		`overlayd_ipam_refused_total{reason="other"} 1`,
		`overlayd_plugin_calls_total{method="IpamDriver.RequestAddress",outcome="ok"} 1`,
		`overlayd_plugin_calls_total{method="IpamDriver.RequestPool",outcome="error"} 0`,
		`overlayd_plugin_calls_total{method="GetCapabilities",outcome="ok"} 0`,
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("scrape lacks %s", want)
		}
	}
}

func scrapeText(t *testing.T, m *Metrics) string {
	t.Helper()
	code, body := get(t, m.Handler(), "/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	return body
}

// BenchmarkObserveCall is what the metrics add to each plugin call (a Join
// takes about a millisecond: BenchmarkJoinLater in package driver).
func BenchmarkObserveCall(b *testing.B) {
	m := New(Sources{})
	for b.Loop() {
		m.ObserveCall("Join", nil, time.Millisecond)
	}
}

// Addresses are counted by family and kind: a dual-stack endpoint counts
// once per family, and a remote peer's state is per address (an IPv6
// claim may be active while the IPv4 one is shadowed); a peer with an
// active address is an active peer.
func TestCollectorCountsAddressesByFamily(t *testing.T) {
	st := driver.Status{Networks: []driver.NetworkStatus{{
		ID: "n6", VNIs: []uint32{400},
		Endpoints: []driver.EndpointStatus{
			{ID: "e1", VNI: 400, Joined: true, Address: "198.51.100.2/24", AddressIPv6: "2001:db8:1::2/64"},
			{ID: "e2", VNI: 400, Joined: true, AddressIPv6: "2001:db8:1::3/64"},
			{ID: "e3", VNI: 400, AddressIPv6: "2001:db8:1::4/64"}, // not joined: no address in use
		},
		RemotePeers: []driver.PeerStatus{
			{VNI: 400, IP: "198.51.100.9", IPv6: "2001:db8:1::9", ActiveIPv6: true},
			{VNI: 400, IPv6: "2001:db8:1::a"},
		},
	}}}
	m := New(Sources{Driver: func() driver.Status { return st }})
	text := scrapeText(t, m)
	for _, want := range []string{
		`overlayd_endpoint_addresses{family="ipv4",kind="local",vni="400"} 1`,
		`overlayd_endpoint_addresses{family="ipv6",kind="local",vni="400"} 2`,
		`overlayd_endpoint_addresses{family="ipv4",kind="remote_shadowed",vni="400"} 1`,
		`overlayd_endpoint_addresses{family="ipv4",kind="remote_active",vni="400"} 0`,
		`overlayd_endpoint_addresses{family="ipv6",kind="remote_active",vni="400"} 1`,
		`overlayd_endpoint_addresses{family="ipv6",kind="remote_shadowed",vni="400"} 1`,
		`overlayd_remote_peers{state="active",vni="400"} 1`,
		`overlayd_remote_peers{state="shadowed",vni="400"} 1`,
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("scrape lacks %s", want)
		}
	}
}
