package driver

import (
	"strings"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"
)

// Every bad CreateNetwork input is refused with an error naming the field and
// what is allowed, and leaves nothing registered.
func TestCreateNetworkBadInput(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq("taken", "100", "192.0.2.0/24"))

	generic := func(kv ...string) *api.CreateNetworkRequest {
		r := createReq("n1", "", "198.51.100.0/24")
		g := r.Options[OptGeneric].(map[string]interface{})
		for i := 0; i+1 < len(kv); i += 2 {
			g[kv[i]] = kv[i+1]
		}
		return r
	}
	tests := []struct {
		name string
		req  *api.CreateNetworkRequest
		want []string // substrings the error must contain
	}{
		{"empty id", createReq("", "101", "198.51.100.0/24"), []string{"NetworkID", "empty"}},
		{"id with slash", createReq("../x", "101", "198.51.100.0/24"), []string{"NetworkID", "../x", "allowed"}},
		{"id already present", createReq("taken", "101", "198.51.100.0/24"), []string{"NetworkID", "taken", "already exists"}},
		{"no vni", createReq("n1", "", "198.51.100.0/24"), []string{"vni", "missing", "-o vni="}},
		{"vni not a number", generic(OptVNI, "abc"), []string{"vni", "abc", "not a number", "1..16777215"}},
		{"vni zero", generic(OptVNI, "0"), []string{"vni", "0", "out of range", "1..16777215"}},
		{"vni too big", generic(OptVNI, "16777216"), []string{"vni", "16777216", "1..16777215"}},
		{"vni listed twice", createReq("n1", "7,7", "198.51.100.0/24", "203.0.113.0/24"), []string{"vni", "twice"}},
		{"vxlanid_list bad", generic(OptVXLANList, "x"), []string{OptVXLANList, "not a number"}},
		{"fewer vnis than subnets", createReq("n1", "101", "198.51.100.0/24", "203.0.113.0/24"), []string{"vni", "1 VNI(s) for 2 IPv4 subnet(s)"}},
		{"more vnis than subnets", createReq("n1", "101,102", "198.51.100.0/24"), []string{"vni", "2 VNI(s) for 1 IPv4 subnet(s)"}},
		{"vni used by another network", createReq("n1", "100", "198.51.100.0/24"), []string{"vni", "100", "already used", "taken"}},
		{"mtu not a number", generic(OptVNI, "101", OptMTU, "big"), []string{OptMTU, "big", "not a number", "576..9000"}},
		{"mtu too small", generic(OptVNI, "101", OptMTU, "1"), []string{OptMTU, "1", "576..9000"}},
		{"mtu too big", generic(OptVNI, "101", OptMTU, "9001"), []string{OptMTU, "9001", "576..9000"}},
		{"encrypted without a cluster key", generic(OptVNI, "101", OptEncrypted, ""), []string{"encrypted", "cluster key"}},
		{"encrypted=maybe", generic(OptVNI, "101", OptEncrypted, "maybe"), []string{"encrypted", "maybe", "true/false"}},
		{"no ipv4 data", createReq("n1", "101"), []string{"IPv4Data", "empty"}},
		{"pool not ipv4", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.IPv4Data[0].Pool = "2001:db8::/64"
			return r
		}(), []string{"IPv4Data[0].Pool", "2001:db8::/64", "IPv4 prefix"}},
		{"gateway outside pool", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.IPv4Data[0].Gateway = "203.0.113.1/24"
			return r
		}(), []string{"IPv4Data[0].Gateway", "203.0.113.1", "outside its pool", "198.51.100.0/24"}},
		{"gateway garbage", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.IPv4Data[0].Gateway = "gw"
			return r
		}(), []string{"IPv4Data[0].Gateway", "\"gw\""}},
		{"overlapping pools", createReq("n1", "101,102", "198.51.100.0/24", "198.51.100.128/25"), []string{"IPv4Data[1].Pool", "overlaps"}},
		{"ipv6 enabled", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.Options[OptEnableV6] = true
			return r
		}(), []string{"IPv6", "not supported yet", OptEnableV6}},
		{"generic not an object", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.Options[OptGeneric] = "vni=5"
			return r
		}(), []string{OptGeneric, "object"}},
		{"option value not a string", func() *api.CreateNetworkRequest {
			r := createReq("n1", "101", "198.51.100.0/24")
			r.Options[OptGeneric].(map[string]interface{})["vni"] = []interface{}{1}
			return r
		}(), []string{"vni", "must be strings"}},
		{"nil request", nil, []string{"empty request"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := d.CreateNetwork(tc.req)
			if err == nil {
				t.Fatalf("CreateNetwork accepted bad input")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			d.mu.Lock()
			defer d.mu.Unlock()
			if len(d.nets) != 1 || len(d.byVNI) != 1 {
				t.Errorf("bad input left state behind: %d networks, %d VNIs", len(d.nets), len(d.byVNI))
			}
		})
	}
}

func TestCreateNetworkAcceptsBuiltinVXLANList(t *testing.T) {
	d := newOfflineDriver(t)
	r := createReq("n1", "", "198.51.100.0/24", "203.0.113.0/24")
	r.Options[OptGeneric].(map[string]interface{})[OptVXLANList] = "300,301"
	mustCreate(t, d, r)
	n, unlock, err := d.lockNetwork("n1")
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if got := formatVNIs(n.vnis()); got != "300,301" {
		t.Fatalf("VNIs %s, want 300,301", got)
	}
}

func TestCreateNetworkMTU(t *testing.T) {
	d := newOfflineDriver(t)
	r := createReq("n1", "5", "198.51.100.0/24")
	r.Options[OptGeneric].(map[string]interface{})[OptMTU] = "1300"
	mustCreate(t, d, r)
	mustCreate(t, d, createReq("n2", "6", "203.0.113.0/24"))
	for id, want := range map[string]int{"n1": 1300, "n2": 1450} {
		n, unlock, err := d.lockNetwork(id)
		if err != nil {
			t.Fatal(err)
		}
		if n.mtu != want {
			t.Errorf("network %s: MTU %d, want %d", id, n.mtu, want)
		}
		unlock()
	}
}

func TestEndpointBadInput(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq("n1", "5", "198.51.100.0/24"))
	mustEndpoint(t, d, "n1", "taken", "198.51.100.2/24")
	tests := []struct {
		name string
		req  *api.CreateEndpointRequest
		want []string
	}{
		{"unknown network", &api.CreateEndpointRequest{NetworkID: "nope", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "198.51.100.3/24"}}, []string{"network", "nope", "not found"}},
		{"empty endpoint id", &api.CreateEndpointRequest{NetworkID: "n1", Interface: &api.EndpointInterface{Address: "198.51.100.3/24"}}, []string{"EndpointID", "empty"}},
		{"no interface", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1"}, []string{"Interface.Address", "empty"}},
		{"bad address", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "x"}}, []string{"Interface.Address", "\"x\""}},
		{"address outside subnets", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "203.0.113.5/24"}}, []string{"Interface.Address", "203.0.113.5", "not in any subnet"}},
		{"bad mac", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "198.51.100.3/24", MacAddress: "zz"}}, []string{"Interface.MacAddress", "zz"}},
		{"multicast mac", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "198.51.100.3/24", MacAddress: "01:00:5e:00:00:01"}}, []string{"Interface.MacAddress", "unicast"}},
		{"ipv6 address", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "198.51.100.3/24", AddressIPv6: "2001:db8::3/64"}}, []string{"AddressIPv6", "not supported"}},
		{"duplicate id", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "taken", Interface: &api.EndpointInterface{Address: "198.51.100.3/24"}}, []string{"EndpointID", "taken", "already exists"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := d.CreateEndpoint(tc.req)
			if err == nil {
				t.Fatal("CreateEndpoint accepted bad input")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
	n, unlock, _ := d.lockNetwork("n1")
	defer unlock()
	if len(n.endpoints) != 1 {
		t.Fatalf("bad input left endpoints behind: %d", len(n.endpoints))
	}
}

// Calls for unknown ids: deletes succeed (dockerd sends them after
// restarts), creates and joins fail clearly.
func TestUnknownIDs(t *testing.T) {
	d := newOfflineDriver(t)
	if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "nope"}); err != nil {
		t.Errorf("DeleteNetwork of unknown id: %v", err)
	}
	if err := d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: "nope", EndpointID: "e"}); err != nil {
		t.Errorf("DeleteEndpoint of unknown network: %v", err)
	}
	if err := d.Leave(&api.LeaveRequest{NetworkID: "nope", EndpointID: "e"}); err != nil {
		t.Errorf("Leave of unknown network: %v", err)
	}
	mustCreate(t, d, createReq("n1", "5", "198.51.100.0/24"))
	if err := d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: "n1", EndpointID: "e"}); err != nil {
		t.Errorf("DeleteEndpoint of unknown endpoint: %v", err)
	}
	if err := d.Leave(&api.LeaveRequest{NetworkID: "n1", EndpointID: "e"}); err != nil {
		t.Errorf("Leave of unknown endpoint: %v", err)
	}
	if _, err := d.Join(&api.JoinRequest{NetworkID: "n1", EndpointID: "e"}); err == nil || !strings.Contains(err.Error(), "\"e\" not found") {
		t.Errorf("Join of unknown endpoint: %v", err)
	}
	if _, err := d.Join(&api.JoinRequest{NetworkID: "nope", EndpointID: "e"}); err == nil || !strings.Contains(err.Error(), "\"nope\" not found") {
		t.Errorf("Join on unknown network: %v", err)
	}
	if _, err := d.EndpointInfo(&api.InfoRequest{NetworkID: "n1", EndpointID: "e"}); err == nil {
		t.Errorf("EndpointInfo of unknown endpoint succeeded")
	}
}

func TestAllocateNetwork(t *testing.T) {
	d := newOfflineDriver(t)
	req := &api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: map[string]string{"foo": "bar"},
		IPv4Data: []api.IPAMData{{Pool: "198.51.100.0/24"}, {Pool: "203.0.113.0/24"}}}
	resp, err := d.AllocateNetwork(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Options["foo"] != "bar" || resp.Options[OptVNI] != "4096,4097" {
		t.Fatalf("AllocateNetwork options %v: want foo echoed and vni=4096,4097", resp.Options)
	}
	// The same request again (leader retry) gives the same VNIs.
	again, err := d.AllocateNetwork(req)
	if err != nil || again.Options[OptVNI] != "4096,4097" {
		t.Fatalf("repeated AllocateNetwork: %v %v", again, err)
	}
	// A restarted leader re-sends its previous output: kept as is, marked used.
	d2 := newOfflineDriver(t)
	re := &api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: resp.Options, IPv4Data: req.IPv4Data}
	out, err := d2.AllocateNetwork(re)
	if err != nil || out.Options[OptVNI] != "4096,4097" || out.Options["foo"] != "bar" {
		t.Fatalf("idempotent AllocateNetwork: %v %v", out, err)
	}
	other, err := d2.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet2", IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}})
	if err != nil || other.Options[OptVNI] != "4098" {
		t.Fatalf("allocation after re-sent output must skip used VNIs: %v %v", other, err)
	}
	if _, err := d2.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet3", Options: map[string]string{OptVNI: "4098"},
		IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}}); err == nil || !strings.Contains(err.Error(), "already allocated") {
		t.Fatalf("VNI given twice to different networks: %v", err)
	}
	if err := d2.FreeNetwork(&api.FreeNetworkRequest{NetworkID: "swarmnet1"}); err != nil {
		t.Fatal(err)
	}
	freed, err := d2.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "swarmnet4", IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}})
	if err != nil || freed.Options[OptVNI] != "4096" {
		t.Fatalf("FreeNetwork must release VNIs: %v %v", freed, err)
	}
	if _, err := d2.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: "x", IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}, Options: map[string]string{OptVNI: "abc"}}); err == nil || !strings.Contains(err.Error(), "not a number") {
		t.Fatalf("bad vni in AllocateNetwork: %v", err)
	}
}

func TestGetCapabilitiesScope(t *testing.T) {
	for _, scope := range []string{"local", "global"} {
		host := newOfflineDriver(t)
		d, err := New(Config{Scope: scope, HostNS: host.hostNS, NetnsDir: "/run/overlayd-test-unused", Logger: testLogger()})
		if err != nil {
			t.Fatal(err)
		}
		c, _ := d.GetCapabilities()
		if c.Scope != scope || c.ConnectivityScope != "global" {
			t.Errorf("capabilities %+v for scope %s", c, scope)
		}
		d.Close()
	}
	if _, err := New(Config{Scope: "cluster"}); err == nil || !strings.Contains(err.Error(), "scope") {
		t.Errorf("bad scope accepted: %v", err)
	}
}
