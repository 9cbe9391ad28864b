package driver

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/testutil/keyhub"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
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
		}(), []string{OptEnableV6, "IPv6Data is empty", "--ipv6 --subnet"}},
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
		// Unknown -o keys: each named, with a did-you-mean for a near miss
		// and the list of known keys; checked before the VNI, so -o vnid=5
		// is not reported as a missing vni.
		{"encrypt for encrypted", generic(OptVNI, "101", "encrypt", ""), []string{`unknown option "encrypt" (did you mean "encrypted"?)`, "overlayd's options are " + userOptionNames()}},
		{"vnid for vni", generic("vnid", "101"), []string{`unknown option "vnid" (did you mean "vni"?)`}},
		{"capitalised key", generic(OptVNI, "101", "Encrypted", ""), []string{`unknown option "Encrypted" (did you mean "encrypted"?)`}},
		{"long key one letter off", generic(OptVNI, "101", "com.docker.network.driver.mtuu", "1400"), []string{`did you mean "com.docker.network.driver.mtu"?`}},
		{"docker flag given as -o", generic(OptVNI, "101", "internal", ""), []string{`unknown option "internal"`, "use docker network create --internal"}},
		{"key like no other", generic(OptVNI, "101", "foo", "bar"), []string{`unknown option "foo": overlayd's options are vni, `}},
		{"two unknown keys", generic(OptVNI, "101", "encrypt", "", "vnid", "7"), []string{`"encrypt" (did you mean "encrypted"?); unknown option "vnid" (did you mean "vni"?)`}},
		{"bridge driver's option", generic(OptVNI, "101", "com.docker.network.bridge.name", "br0"), []string{`unknown option "com.docker.network.bridge.name"`}},
		// mtu is an alias of com.docker.network.driver.mtu.
		{"mtu alias not a number", generic(OptVNI, "101", OptMTUAlias, "big"), []string{`option mtu="big" is not a number`, "576..9000"}},
		{"mtu alias too big", generic(OptVNI, "101", OptMTUAlias, "9001"), []string{"option mtu=9001 is out of range", "576..9000"}},
		{"mtu given twice, differently", generic(OptVNI, "101", OptMTUAlias, "1400", OptMTU, "1300"), []string{`mtu="1400"`, OptMTU + `="1300"`, "give only one"}},
		{"vni and vxlanid_list differ", generic(OptVNI, "101", OptVXLANList, "102"), []string{`vni="101"`, OptVXLANList + `="102"`, "give only one"}},
		{"explicit-subnet=maybe", generic(OptVNI, "101", OptExplicitSubnet, "maybe"), []string{OptExplicitSubnet, "maybe", "true/false"}},
		// Pools dockerd hands out without --subnet (scope local).
		{"172.x default pool", createReq("n1", "101", "172.18.0.0/16"), []string{"IPv4Data[0].Pool 172.18.0.0/16", "default address pools", "without --subnet", "same --subnet on every host", "-o " + OptExplicitSubnet}},
		{"192.168 default pool", createReq("n1", "101,102", "198.51.100.0/24", "192.168.16.0/20"), []string{"IPv4Data[1].Pool 192.168.16.0/20", "default address pools"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { wantCreateRefused(t, d, tc.req, tc.want) })
	}
}

// wantCreateRefused checks that CreateNetwork refuses req with an error
// mentioning each of want, and leaves only the one network d had.
func wantCreateRefused(t *testing.T, d *Driver, req *api.CreateNetworkRequest, want []string) {
	t.Helper()
	err := d.CreateNetwork(req)
	if err == nil {
		t.Fatalf("CreateNetwork accepted bad input")
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not mention %q", err, w)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.nets) != 1 || len(d.byVNI) != 1 {
		t.Errorf("bad input left state behind: %d networks, %d VNIs", len(d.nets), len(d.byVNI))
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
		{"ipv6 address", &api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e1", Interface: &api.EndpointInterface{Address: "198.51.100.3/24", AddressIPv6: "2001:db8::3/64"}}, []string{"AddressIPv6", "2001:db8::3/64", "has no IPv6 subnet"}},
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
	req := &api.AllocateNetworkRequest{NetworkID: "swarmnet1", Options: map[string]string{OptMTUAlias: "1400"},
		IPv4Data: []api.IPAMData{{Pool: "198.51.100.0/24"}, {Pool: "203.0.113.0/24"}}}
	resp, err := d.AllocateNetwork(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Options[OptMTUAlias] != "1400" || resp.Options[OptVNI] != "4096,4097" {
		t.Fatalf("AllocateNetwork options %v: want mtu echoed and vni=4096,4097", resp.Options)
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
	if err != nil || out.Options[OptVNI] != "4096,4097" || out.Options[OptMTUAlias] != "1400" {
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
		d, err := New(alone(Config{Scope: scope, HostNS: host.hostNS, NetnsDir: "/run/overlayd-test-unused", Logger: testLogger()}))
		if err != nil {
			t.Fatal(err)
		}
		c, _ := d.GetCapabilities()
		if c.Scope != scope || c.ConnectivityScope != "global" {
			t.Errorf("capabilities %+v for scope %s", c, scope)
		}
		d.Close()
	}
	if _, err := New(alone(Config{Scope: "cluster"})); err == nil || !strings.Contains(err.Error(), "scope") {
		t.Errorf("bad scope accepted: %v", err)
	}
}

// Every interface of the control plane is required: New refuses a Config
// without one, naming each missing field, before it touches anything.
func TestNewRequiresControlPlane(t *testing.T) {
	full := alone(Config{NetnsDir: "/run/overlayd-test-unused"})
	for _, c := range []struct {
		field string
		drop  func(*Config)
	}{
		{"Config.Publisher", func(c *Config) { c.Publisher = nil }},
		{"Config.Peers", func(c *Config) { c.Peers = nil }},
		{"Config.Definitions", func(c *Config) { c.Definitions = nil }},
		{"Config.Membership", func(c *Config) { c.Membership = nil }},
	} {
		cfg := full
		c.drop(&cfg)
		if d, err := New(cfg); err == nil || !strings.Contains(err.Error(), c.field) {
			if d != nil {
				d.Close()
			}
			t.Errorf("New without %s: %v; want an error naming it", c.field, err)
		}
	}
	_, err := New(Config{NetnsDir: "/run/overlayd-test-unused"})
	for _, f := range []string{"Publisher", "Peers", "Definitions", "Membership"} {
		if err == nil || !strings.Contains(err.Error(), "Config."+f) {
			t.Errorf("New without a control plane: %v; want every missing field named (%s)", err, f)
		}
	}
}

// The known keys are accepted: mtu sets the MTU like Docker's name for it
// (both may be given if they agree), explicit-subnet lets a pool that looks
// like dockerd's default through, and the swarm-internal overlayd.seeds
// passes.
func TestCreateNetworkKnownOptions(t *testing.T) {
	d := newOfflineDriver(t)
	for _, tc := range []struct {
		id, vni, pool string
		kv            []string
		mtu           int
	}{
		{"alias", "5", "198.51.100.0/24", []string{OptMTUAlias, "1300"}, 1300},
		{"both-agree", "6", "203.0.113.0/24", []string{OptMTUAlias, "1350", OptMTU, "1350"}, 1350},
		{"explicit", "7", "172.18.0.0/16", []string{OptExplicitSubnet, ""}, 1450},
		{"not-default", "8", "192.168.5.0/24", nil, 1450},
		{"seeds", "9", "192.0.2.0/24", []string{"overlayd.seeds", "192.0.2.10:7947"}, 1450},
	} {
		r := createReq(tc.id, tc.vni, tc.pool)
		for i := 0; i+1 < len(tc.kv); i += 2 {
			r.Options[OptGeneric].(map[string]interface{})[tc.kv[i]] = tc.kv[i+1]
		}
		mustCreate(t, d, r)
		n, unlock, err := d.lockNetwork(tc.id)
		if err != nil {
			t.Fatal(err)
		}
		if n.mtu != tc.mtu {
			t.Errorf("network %s: MTU %d, want %d", tc.id, n.mtu, tc.mtu)
		}
		unlock()
	}
}

// A swarm driver (scope global) takes any pool: swarm's allocator hands out
// cluster-wide unique ones.
func TestCreateNetworkDefaultPoolInSwarm(t *testing.T) {
	host := newOfflineDriver(t)
	d, err := New(alone(Config{Scope: "global", HostNS: host.hostNS, NetnsDir: "/run/overlayd-test-unused", Logger: testLogger()}))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	mustCreate(t, d, createReq("n1", "4096", "172.18.0.0/16"))
}

// An MTU the underlay cannot carry is refused naming the asked MTU, the
// largest allowed and the underlay device's MTU, read from the device that
// holds the VTEP (here eth0 set to 1400); the largest itself is accepted.
func TestCreateNetworkMTUAboveUnderlay(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	eth0, err := hosts[0].NL.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := hosts[0].NL.LinkSetMTU(eth0, 1400); err != nil {
		t.Fatal(err)
	}
	d, _ := encDriver(t, hosts[0], vteps[0], func() error { return nil }, keyhub.New())
	for _, tc := range []struct {
		key       string
		mtu       int
		encrypted bool
		want      []string
	}{
		{OptMTUAlias, 1351, false, []string{"option mtu=1351", "the largest MTU is 1350", "device eth0 has MTU 1400", "VXLAN over IPv4 takes 50 bytes"}},
		{OptMTU, 9000, false, []string{"option " + OptMTU + "=9000", "the largest MTU is 1350", "MTU 1400"}},
		{OptMTUAlias, 1317, true, []string{"option mtu=1317", "the largest MTU is 1316", "MTU 1400", "ESP-encrypted VXLAN over IPv4 takes 84 bytes"}},
	} {
		r := createReq("big", "10", "198.51.100.0/24")
		g := r.Options[OptGeneric].(map[string]interface{})
		g[tc.key] = strconv.Itoa(tc.mtu)
		if tc.encrypted {
			g[OptEncrypted] = ""
		}
		err := d.CreateNetwork(r)
		if err == nil {
			t.Fatalf("%s=%d (encrypted %v) on a 1400-byte underlay accepted", tc.key, tc.mtu, tc.encrypted)
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("error %q does not mention %q", err, w)
			}
		}
		if st := d.Status(); len(st.Networks) != 0 {
			t.Fatalf("refused network registered: %+v", st.Networks)
		}
	}
	plain := createReq("plain", "11", "198.51.100.0/24")
	plain.Options[OptGeneric].(map[string]interface{})[OptMTUAlias] = "1350"
	mustCreate(t, d, plain)
	enc := createReq("enc", "12", "203.0.113.0/24")
	enc.Options[OptGeneric].(map[string]interface{})[OptMTUAlias] = "1316"
	enc.Options[OptGeneric].(map[string]interface{})[OptEncrypted] = ""
	mustCreate(t, d, enc)
}

// A swarm network with a bad option is allocated (a refusal would only
// reach the manager's log), the leader says so at WARN, and every node's
// CreateNetwork of what AllocateNetwork returned refuses it with the
// message, which docker service ps shows.
func TestAllocateNetworkBadOptions(t *testing.T) {
	var logs bytes.Buffer
	d := newOfflineDriver(t)
	d.log = slog.New(slog.NewTextHandler(&logs, nil))
	for i, tc := range []struct {
		opts map[string]string
		want string
	}{
		{map[string]string{"encrypt": ""}, `unknown option "encrypt" (did you mean "encrypted"?)`},
		{map[string]string{OptMTUAlias: "abc"}, `option mtu="abc" is not a number`},
		{map[string]string{OptEncrypted: "maybe"}, `option encrypted="maybe"`},
	} {
		logs.Reset()
		id := fmt.Sprintf("sw%d", i)
		resp, err := d.AllocateNetwork(&api.AllocateNetworkRequest{NetworkID: id, Options: tc.opts, IPv4Data: []api.IPAMData{{Pool: "192.0.2.0/24"}}})
		if err != nil {
			t.Fatalf("AllocateNetwork with %v: %v", tc.opts, err)
		}
		if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "will refuse") || !strings.Contains(logs.String(), id) {
			t.Errorf("AllocateNetwork with %v logged no warning naming the network: %q", tc.opts, logs.String())
		}
		node := createReq(id, "", "192.0.2.0/24")
		for k, v := range resp.Options {
			node.Options[OptGeneric].(map[string]interface{})[k] = v
		}
		if err := d.CreateNetwork(node); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("node's CreateNetwork with %v: error %v, want %q", resp.Options, err, tc.want)
		}
	}
	// Good options and the leader's own output (vni, seeds, coming back
	// after its restart) pass without a warning about options (the one
	// dnsrr notice per swarm network is TestAllocateNetworkWarnsDNSRROnce's).
	logs.Reset()
	req := &api.AllocateNetworkRequest{NetworkID: "good", Options: map[string]string{"overlayd.seeds": "192.0.2.10:7947", OptEncrypted: "false"}, IPv4Data: []api.IPAMData{{Pool: "198.51.100.0/24"}}}
	resp, err := d.AllocateNetwork(req)
	if err != nil {
		t.Fatal(err)
	}
	req.Options = resp.Options
	if _, err := d.AllocateNetwork(req); err != nil {
		t.Fatalf("AllocateNetwork of its own output: %v", err)
	}
	if strings.Contains(logs.String(), "will refuse") || strings.Count(logs.String(), "level=WARN") > 1 {
		t.Errorf("good options logged: %q", logs.String())
	}
}

// The options table (docs/networks.md) lists every known key with its values and meaning,
// and says which one is internal.
func TestOptionsMarkdown(t *testing.T) {
	md := optionsMarkdown()
	for _, o := range knownOptions {
		row := fmt.Sprintf("| `%s` | %s | %s |", o.name, o.values, o.meaning)
		if !strings.Contains(md, row) {
			t.Errorf("table lacks the row of %s:\n%s", o.name, md)
		}
		if o.internal != strings.HasPrefix(o.meaning, "internal:") {
			t.Errorf("option %s: internal %v but its meaning does not say so: %q", o.name, o.internal, o.meaning)
		}
		if !o.internal && !strings.Contains(userOptionNames(), o.name) {
			t.Errorf("user option %s is missing from the error's list %q", o.name, userOptionNames())
		}
	}
	if strings.Contains(userOptionNames(), "overlayd.seeds") {
		t.Errorf("the internal key is offered to users: %s", userOptionNames())
	}
}

// TestDocsOptionsTable keeps the options table of docs/networks.md the one
// the unknown-option error is made from: a key added to knownOptions but not
// documented (or documented differently) fails here.
func TestDocsOptionsTable(t *testing.T) {
	page, err := os.ReadFile("../docs/networks.md")
	if err != nil {
		t.Fatalf("read the options page: %v", err)
	}
	if want := optionsMarkdown(); !strings.Contains(string(page), want) {
		t.Errorf("docs/networks.md does not hold the options table of driver/optkeys.go; put this under \"Options (-o)\":\n%s", want)
	}
}
