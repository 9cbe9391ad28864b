package driver

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/statefile"
)

// createReq6 is createReq for a network with IPv6: pools of either family,
// each in its IPAMData list, the gateway the first address of each, and
// com.docker.network.enable_ipv6 set, as dockerd sends for --ipv6.
func createReq6(id, vni string, pools ...string) *api.CreateNetworkRequest {
	var v4 []string
	var v6 []*api.IPAMData
	for _, p := range pools {
		pfx := netip.MustParsePrefix(p)
		if pfx.Addr().Is4() {
			v4 = append(v4, p)
			continue
		}
		gw := netip.PrefixFrom(pfx.Addr().Next(), pfx.Bits())
		v6 = append(v6, &api.IPAMData{AddressSpace: "LocalDefault", Pool: p, Gateway: gw.String()})
	}
	req := createReq(id, vni, v4...)
	req.IPv6Data = v6
	req.Options[OptEnableV6] = true
	return req
}

// endpointReq6 returns a CreateEndpoint request with these addresses
// (either may be "").
func endpointReq6(nid, eid, addr, addr6 string) *api.CreateEndpointRequest {
	return &api.CreateEndpointRequest{NetworkID: nid, EndpointID: eid, Interface: &api.EndpointInterface{Address: addr, AddressIPv6: addr6}}
}

// Every bad IPv6 input of CreateNetwork is refused with an error naming
// the field and what is allowed, and leaves nothing registered.
func TestCreateNetworkIPv6BadInput(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq6("taken", "100", "192.0.2.0/24", "2001:db8:100::/64"))
	withV6 := func(pool, gw string) *api.CreateNetworkRequest {
		r := createReq6("n1", "101", "198.51.100.0/24")
		r.IPv6Data = []*api.IPAMData{{Pool: pool, Gateway: gw}}
		return r
	}
	tests := []struct {
		name string
		req  *api.CreateNetworkRequest
		want []string
	}{
		{"pool not a prefix", withV6("2001:db8::", ""), []string{"IPv6Data[0].Pool", `"2001:db8::"`, "not an IPv6 prefix"}},
		{"pool is IPv4", withV6("203.0.113.0/24", ""), []string{"IPv6Data[0].Pool", "203.0.113.0/24", "not an IPv6 prefix"}},
		{"pool v4-mapped", withV6("::ffff:203.0.113.0/120", ""), []string{"IPv6Data[0].Pool", "IPv4-mapped", "give IPv4 subnets as IPv4"}},
		{"pool link-local", withV6("fe80::/64", ""), []string{"IPv6Data[0].Pool", "fe80::/64", "link-local (fe80::/10)"}},
		{"pool multicast", withV6("ff05::/64", ""), []string{"IPv6Data[0].Pool", "multicast (ff00::/8)"}},
		{"pool unspecified", withV6("::/64", ""), []string{"IPv6Data[0].Pool", "loopback or unspecified"}},
		{"pool loopback", withV6("::1/128", ""), []string{"IPv6Data[0].Pool", "at most 120"}},
		{"pool too long", withV6("2001:db8::/121", ""), []string{"IPv6Data[0].Pool", "2001:db8::/121", "too small", "at most 120"}},
		{"gateway outside", withV6("2001:db8:1::/64", "2001:db8:2::1/64"), []string{"IPv6Data[0].Gateway", "2001:db8:2::1", "outside its pool", "2001:db8:1::/64"}},
		{"gateway IPv4", withV6("2001:db8:1::/64", "198.51.100.1/24"), []string{"IPv6Data[0].Gateway", "not an IPv6 address"}},
		{"gateway subnet-router anycast", withV6("2001:db8:1::/64", "2001:db8:1::/64"), []string{"IPv6Data[0].Gateway", "subnet-router anycast"}},
		{"overlapping v6 pools", createReq6("n1", "101", "2001:db8:1::/64", "2001:db8:1::/80"), []string{"IPv6Data[1].Pool", "overlaps", "IPv6Data[0].Pool"}},
		{"two IPv4 subnets with IPv6", createReq6("n1", "101", "198.51.100.0/24", "203.0.113.0/24", "2001:db8:1::/64"), []string{"IPv4Data", "2 subnets", "at most one IPv4 subnet"}},
		{"two VNIs with IPv6", createReq6("n1", "101,102", "198.51.100.0/24", "2001:db8:1::/64"), []string{"vni", "2 VNIs", "give one VNI"}},
		{"MTU below 1280", func() *api.CreateNetworkRequest {
			r := createReq6("n1", "101", "198.51.100.0/24", "2001:db8:1::/64")
			r.Options[OptGeneric].(map[string]interface{})[OptMTU] = "1200"
			return r
		}(), []string{OptMTU + "=1200", "at least 1280"}},
		{"enable_ipv6 without IPv6Data", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.Options[OptEnableV6] = true
			return r
		}(), []string{OptEnableV6, "IPv6Data is empty"}},
		{"IPv6Data with enable_ipv6 false", func() *api.CreateNetworkRequest {
			r := createReq6("n1", "101", "198.51.100.0/24", "2001:db8:1::/64")
			r.Options[OptEnableV6] = false
			return r
		}(), []string{"IPv6Data", OptEnableV6, "is false"}},
		{"enable_ipv6 not a boolean", func() *api.CreateNetworkRequest {
			r := createReq6("n1", "101", "198.51.100.0/24", "2001:db8:1::/64")
			r.Options[OptEnableV6] = "maybe"
			return r
		}(), []string{OptEnableV6, "not a boolean"}},
		{"null IPv6Data entry", func() *api.CreateNetworkRequest {
			r := createReq6("n1", "101", "198.51.100.0/24")
			r.IPv6Data = []*api.IPAMData{nil}
			return r
		}(), []string{"IPv6Data[0]", "null"}},
		{"neither family", func() *api.CreateNetworkRequest {
			r := createReq6("n1", "101")
			r.Options[OptEnableV6] = false
			return r
		}(), []string{"IPv4Data is empty"}},
		{"VNI taken", createReq6("n1", "100", "2001:db8:1::/64"), []string{"VNI 100", "already used", "taken"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { wantCreateRefused(t, d, tc.req, tc.want) })
	}
}

// A network with IPv6 is one segment: one VNI for its IPv4 subnet and all
// its IPv6 subnets (dual-stack), or for its IPv6 subnets alone.
func TestCreateNetworkIPv6OneSegment(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq6("dual", "200", "198.51.100.0/24", "2001:db8:1::/64", "2001:db8:2::/64"))
	mustCreate(t, d, createReq6("v6only", "201", "2001:db8:3::/64"))
	st := d.Status()
	got := map[string]string{}
	for _, n := range st.Networks {
		got[n.ID] = fmt.Sprint(n.VNIs, n.Subnets)
	}
	want := map[string]string{
		"dual":   "[200] [198.51.100.0/24 2001:db8:1::/64 2001:db8:2::/64]",
		"v6only": "[201] [2001:db8:3::/64]",
	}
	for id, w := range want {
		if got[id] != w {
			t.Errorf("network %s: %s, want %s", id, got[id], w)
		}
	}
	// The definition other hosts compare carries the IPv6 subnets.
	defs := d.LocalDefinitions()
	if def := defs[200]; len(def.Subnets) != 1 || len(def.Subnets[0].IPv6) != 2 || def.Subnets[0].IPv6[1].Gateway.String() != "2001:db8:2::1/64" {
		t.Errorf("definition of VNI 200: %+v", def)
	}
}

// Every bad IPv6 endpoint input is refused naming the field.
func TestEndpointIPv6BadInput(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq6("dual", "200", "198.51.100.0/24", "2001:db8:1::/64"))
	mustCreate(t, d, createReq6("v6only", "201", "2001:db8:3::/64"))
	mustCreate(t, d, createReq("v4only", "202", "203.0.113.0/24"))
	tests := []struct {
		name string
		req  *api.CreateEndpointRequest
		want []string
	}{
		{"no address at all", endpointReq6("dual", "e1", "", ""), []string{"Interface.Address and Interface.AddressIPv6 are empty"}},
		{"v6 not an address", endpointReq6("dual", "e1", "198.51.100.2/24", "x"), []string{"Interface.AddressIPv6", `"x"`, "not an IPv6 address"}},
		{"v6 is IPv4", endpointReq6("dual", "e1", "198.51.100.2/24", "198.51.100.3/24"), []string{"Interface.AddressIPv6", "not an IPv6 address"}},
		{"v6 is v4-mapped", endpointReq6("dual", "e1", "198.51.100.2/24", "::ffff:198.51.100.3/120"), []string{"Interface.AddressIPv6", "not an IPv6 address"}},
		{"v6 outside subnets", endpointReq6("dual", "e1", "198.51.100.2/24", "2001:db8:9::2/64"), []string{"Interface.AddressIPv6", "2001:db8:9::2/64", "not in any IPv6 subnet", "dual"}},
		{"v4 outside subnets", endpointReq6("dual", "e1", "203.0.113.2/24", "2001:db8:1::2/64"), []string{"Interface.Address", "203.0.113.2/24", "not in any subnet"}},
		{"v4 on an IPv6-only network", endpointReq6("v6only", "e1", "198.51.100.2/24", "2001:db8:3::2/64"), []string{"Interface.Address", "IPv6-only", "no IPv4 address"}},
		{"v6 on an IPv4-only network", endpointReq6("v4only", "e1", "203.0.113.2/24", "2001:db8:1::2/64"), []string{"Interface.AddressIPv6", "has no IPv6 subnet", "--ipv6"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := d.CreateEndpoint(tc.req); err == nil {
				t.Fatal("CreateEndpoint accepted bad input")
			} else {
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not mention %q", err, w)
					}
				}
			}
		})
	}
	for _, id := range []string{"dual", "v6only", "v4only"} {
		n, unlock, _ := d.lockNetwork(id)
		if len(n.endpoints) != 0 {
			t.Errorf("network %s: bad input left %d endpoints", id, len(n.endpoints))
		}
		unlock()
	}
}

// Join gives a dual-stack endpoint the IPv6 gateway of its subnet and
// on-link routes to the network's other IPv6 subnets; an IPv6-only
// endpoint gets no IPv4 gateway.
func TestJoinIPv6Response(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq6("dual", "200", "198.51.100.0/24", "2001:db8:1::/64", "2001:db8:2::/64", "2001:db8:3::/64"))
	if _, err := d.CreateEndpoint(endpointReq6("dual", "e1", "198.51.100.2/24", "2001:db8:2::2/64")); err != nil {
		t.Fatal(err)
	}
	resp := mustJoin(t, d, "dual", "e1")
	if resp.GatewayIPv6 != "2001:db8:2::1" {
		t.Errorf("GatewayIPv6 %q, want 2001:db8:2::1", resp.GatewayIPv6)
	}
	var routes []string
	for _, r := range resp.StaticRoutes {
		routes = append(routes, fmt.Sprintf("%s type %d via %q", r.Destination, r.RouteType, r.NextHop))
	}
	want := []string{`2001:db8:1::/64 type 1 via ""`, `2001:db8:3::/64 type 1 via ""`}
	if !slices.Equal(routes, want) {
		t.Errorf("static routes %q, want %q", routes, want)
	}
	mustAudit(t, d)

	mustCreate(t, d, createReq6("v6only", "201", "2001:db8:9::/64"))
	if _, err := d.CreateEndpoint(endpointReq6("v6only", "e2", "", "2001:db8:9::2/64")); err != nil {
		t.Fatal(err)
	}
	resp = mustJoin(t, d, "v6only", "e2")
	if resp.Gateway != "" || resp.GatewayIPv6 != "2001:db8:9::1" || len(resp.StaticRoutes) != 0 {
		t.Errorf("Join of an IPv6-only endpoint: %+v", resp)
	}
	mustAudit(t, d)
}

// The state file keeps a network's IPv6 subnets and an endpoint's IPv6
// address; a record written before IPv6 (no IPv6 fields) loads as before.
func TestIPv6Record(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq6("dual", "200", "198.51.100.0/24", "2001:db8:1::/64", "2001:db8:2::/64"))
	mustCreate(t, d, createReq6("v6only", "201", "2001:db8:3::/64"))
	for _, tc := range []struct{ net, addr, addr6 string }{{"dual", "198.51.100.2/24", "2001:db8:2::2/64"}, {"v6only", "", "2001:db8:3::2/64"}} {
		if _, err := d.CreateEndpoint(endpointReq6(tc.net, "e-"+tc.net, tc.addr, tc.addr6)); err != nil {
			t.Fatal(err)
		}
		n, unlock, _ := d.lockNetwork(tc.net)
		rec := n.recordLocked()
		back, err := networkFromRecord(rec)
		if err != nil {
			unlock()
			t.Fatalf("network %s from its record %+v: %v", tc.net, rec, err)
		}
		if a, b := n.definitionLocked(), back.definitionLocked(); !equalDefs(&a, &b) {
			t.Errorf("network %s: record gives %+v, want %+v", tc.net, b, a)
		}
		ep := n.endpoints["e-"+tc.net]
		epBack, err := endpointFromRecord(back, ep.recordLocked(n.id))
		unlock()
		if err != nil {
			t.Fatalf("endpoint of %s from its record: %v", tc.net, err)
		}
		if epBack.addr != ep.addr || epBack.addr6 != ep.addr6 || epBack.subnet != 0 {
			t.Errorf("endpoint of %s: record gives %v %v, want %v %v", tc.net, epBack.addr, epBack.addr6, ep.addr, ep.addr6)
		}
	}
}

func equalDefs(a, b *netdef.Definition) bool { return netdef.Equal(a, b) }

// The swarm leader allocates one VNI for a network with IPv6 (one
// segment), and refuses a given list with more.
func TestAllocateNetworkIPv6OneVNI(t *testing.T) {
	d := newOfflineDriver(t)
	v4 := []api.IPAMData{{Pool: "198.51.100.0/24"}, {Pool: "203.0.113.0/24"}}
	v6 := []api.IPAMData{{Pool: "2001:db8:1::/64"}, {Pool: "2001:db8:2::/64"}}
	resp, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "dual", IPv4Data: v4[:1], IPv6Data: v6})
	if err != nil {
		t.Fatal(err)
	}
	if vnis := resp.Options[OptVNI]; strings.Contains(vnis, ",") || vnis == "" {
		t.Errorf("a dual-stack network got VNIs %q, want one", vnis)
	}
	resp, err = d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "v6only", IPv6Data: v6})
	if err != nil {
		t.Fatal(err)
	}
	if vnis := resp.Options[OptVNI]; strings.Contains(vnis, ",") || vnis == "" {
		t.Errorf("an IPv6-only network got VNIs %q, want one", vnis)
	}
	_, err = d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "given", IPv4Data: v4[:1], IPv6Data: v6, Options: map[string]string{OptVNI: "900,901"}})
	if err == nil || !strings.Contains(err.Error(), "2 VNI(s) for 1 segment(s)") {
		t.Errorf("two VNIs given for a network with IPv6: %v", err)
	}
}

// A record written before IPv6 loads as it always did; a damaged IPv6
// record is refused, saying what is wrong.
func TestIPv6RecordOldAndDamaged(t *testing.T) {
	old := statefile.Network{ID: "old", VNIs: []uint32{7}, Pools: []string{"198.51.100.0/24"}, Gateways: []string{"198.51.100.1/24"}, MTU: 1450}
	n, err := networkFromRecord(old)
	if err != nil || n.hasIPv6() || fmt.Sprint(n.pools()) != "[198.51.100.0/24]" {
		t.Fatalf("record from before IPv6: %v, %v", n, err)
	}
	for _, tc := range []struct {
		rec  statefile.Network
		want string
	}{
		{statefile.Network{ID: "ll", VNIs: []uint32{8}, Pools: []string{""}, Gateways: []string{""}, Pools6: []string{"fe80::/64"}, Gateways6: []string{""}, MTU: 1450}, "link-local"},
		{statefile.Network{ID: "two", VNIs: []uint32{8, 9}, Pools: []string{"198.51.100.0/24", "203.0.113.0/24"}, Gateways: []string{"", ""}, Pools6: []string{"2001:db8::/64"}, Gateways6: []string{""}, MTU: 1450}, "several segments"},
		{statefile.Network{ID: "gws", VNIs: []uint32{8}, Pools: []string{""}, Gateways: []string{""}, Pools6: []string{"2001:db8::/64"}, MTU: 1450}, "do not match"},
		{statefile.Network{ID: "mtu", VNIs: []uint32{8}, Pools: []string{""}, Gateways: []string{""}, Pools6: []string{"2001:db8::/64"}, Gateways6: []string{""}, MTU: 1200}, "below 1280"},
	} {
		if _, err := networkFromRecord(tc.rec); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("record %s: %v, want an error saying %q", tc.rec.ID, err, tc.want)
		}
	}
}
