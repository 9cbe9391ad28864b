package netspec

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/moby/moby/api/types/network"
)

func inspect() network.Inspect {
	return network.Inspect{Network: network.Network{
		Name: "net1", ID: "abc", Scope: "local", Driver: "overlayd", EnableIPv4: true, EnableIPv6: true,
		IPAM: network.IPAM{Driver: "overlayd", Options: map[string]string{"o": "1"}, Config: []network.IPAMConfig{
			{Subnet: netip.MustParsePrefix("192.0.2.0/24"), IPRange: netip.MustParsePrefix("192.0.2.128/25"), Gateway: netip.MustParseAddr("192.0.2.1"),
				AuxAddress: map[string]netip.Addr{"router": netip.MustParseAddr("192.0.2.2")}},
			{Subnet: netip.MustParsePrefix("2001:db8:1::/64")},
		}},
		Internal: true, Attachable: true,
		Options: map[string]string{"vni": "4242", "encrypted": ""},
		Labels:  map[string]string{"com.example.team": "a"},
	}}
}

// A spec made from an inspect creates, on another engine, a network whose
// inspect gives the same spec: every field the user set survives.
func TestCreateOptionsRecreateTheSpec(t *testing.T) {
	s, err := FromInspect(inspect())
	if err != nil {
		t.Fatal(err)
	}
	o := s.CreateOptions("overlayd:latest")
	if o.Driver != "overlayd:latest" {
		t.Fatalf("driver %q", o.Driver)
	}
	// What an engine shows of a network created with o.
	again := network.Inspect{Network: network.Network{
		Name: s.Name, Scope: "local", Driver: o.Driver, EnableIPv4: o.EnableIPv4 == nil || *o.EnableIPv4, EnableIPv6: *o.EnableIPv6,
		IPAM: *o.IPAM, Internal: o.Internal, Attachable: o.Attachable, Options: o.Options, Labels: o.Labels,
	}}
	s2, err := FromInspect(again)
	if err != nil {
		t.Fatal(err)
	}
	if d := Diff(&s, &s2); d != nil {
		t.Fatalf("recreated network differs: %v", d)
	}
	// The request must not share maps with the spec (the caller may
	// change either).
	o.Options["vni"] = "1"
	if s.Options["vni"] != "4242" {
		t.Fatal("CreateOptions shares the options map")
	}
}

// Engines before 28 have no EnableIPv4: a network with an IPv4 pool has
// IPv4; an IPv6-only network of 28 sends the switch, off.
func TestIPv4OfOlderEngines(t *testing.T) {
	in := inspect()
	in.EnableIPv4 = false // 20.10 and 26.1 do not have the field
	s, err := FromInspect(in)
	if err != nil || !s.IPv4 {
		t.Fatalf("IPv4 = %v, %v; want true (an IPv4 pool)", s.IPv4, err)
	}
	if o := s.CreateOptions("overlayd"); o.EnableIPv4 != nil {
		t.Fatalf("EnableIPv4 sent for a network with IPv4: %v", *o.EnableIPv4)
	}
	in.IPAM.Config = in.IPAM.Config[1:]
	s, err = FromInspect(in)
	if err != nil || s.IPv4 {
		t.Fatalf("IPv6-only: IPv4 = %v, %v", s.IPv4, err)
	}
	if o := s.CreateOptions("overlayd"); o.EnableIPv4 == nil || *o.EnableIPv4 {
		t.Fatal("IPv6-only network created without EnableIPv4=false")
	}
}

func TestFromInspectLeavesSwarmAndConfigNetworksAlone(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*network.Inspect)
	}{
		{"swarm", func(n *network.Inspect) { n.Scope = "swarm" }},
		{"config-only", func(n *network.Inspect) { n.ConfigOnly = true }},
		{"config-from", func(n *network.Inspect) { n.ConfigFrom.Network = "cfg" }},
		{"ingress", func(n *network.Inspect) { n.Ingress = true }},
	} {
		in := inspect()
		tc.edit(&in)
		_, err := FromInspect(in)
		var u *Unreplicable
		if !errors.As(err, &u) || u.Network != "net1" {
			t.Errorf("%s: error %v, want *Unreplicable naming net1", tc.name, err)
		}
	}
}

// Every field that differs is named with both values.
func TestDiffNamesEveryField(t *testing.T) {
	a, _ := FromInspect(inspect())
	if d := Diff(&a, &a); d != nil || !Equal(&a, &a) {
		t.Fatalf("a spec differs from itself: %v", d)
	}
	in := inspect()
	in.Name = "net2"
	in.Options = map[string]string{"vni": "4243"}
	in.IPAM.Driver = "default"
	in.IPAM.Options = nil
	in.IPAM.Config = in.IPAM.Config[:1]
	in.Internal, in.Attachable, in.EnableIPv6 = false, false, false
	in.Labels = map[string]string{"com.example.team": "b"}
	b, err := FromInspect(in)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"name: net1 here, net2 there",
		"driver options: {encrypted=,vni=4242} here, {vni=4243} there",
		"IPAM driver: overlayd here, default there",
		"IPAM options: {o=1} here, {} there",
		"IPAM pools: [192.0.2.0/24 range 192.0.2.128/25 gw 192.0.2.1 aux router=192.0.2.2; 2001:db8:1::/64] here, [192.0.2.0/24 range 192.0.2.128/25 gw 192.0.2.1 aux router=192.0.2.2] there",
		"internal: yes here, no there",
		"IPv6: yes here, no there",
		"attachable: yes here, no there",
		"labels: {com.example.team=a} here, {com.example.team=b} there",
	}
	if d := Diff(&a, &b); !slices.Equal(d, want) {
		t.Fatalf("Diff:\n%s\nwant:\n%s", strings.Join(d, "\n"), strings.Join(want, "\n"))
	}
}

func TestValidateNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		edit func(*Spec)
		want string
	}{
		{func(s *Spec) { s.Name = "" }, `network name "": must be 1..128 bytes`},
		{func(s *Spec) { s.Name = strings.Repeat("n", 129) }, "must be 1..128 bytes"},
		{func(s *Spec) { s.Name = "a/b" }, `byte 2 ('/') is not allowed`},
		{func(s *Spec) { s.Name = "-x" }, `must not start with '-'`},
		{func(s *Spec) { s.Pools[0].Subnet = netip.MustParsePrefix("192.0.2.7/24") }, "pool 1: subnet 192.0.2.7/24: has host bits set (want 192.0.2.0/24)"},
		{func(s *Spec) { s.Pools[0].Gateway = netip.MustParseAddr("198.51.100.1") }, "pool 1: gateway 198.51.100.1: not inside subnet 192.0.2.0/24"},
		{func(s *Spec) { s.Pools[0].IPRange = netip.MustParsePrefix("192.0.0.0/16") }, "pool 1: IP range 192.0.0.0/16: not inside subnet"},
		{func(s *Spec) { s.Pools[1].Aux = map[string]netip.Addr{"x": netip.MustParseAddr("192.0.2.9")} }, "pool 2: auxiliary address x=192.0.2.9: not inside subnet 2001:db8:1::/64"},
		{func(s *Spec) { s.Pools[0].Subnet = netip.Prefix{} }, "pool 1: no subnet"},
		{func(s *Spec) { s.Labels[""] = "v" }, `labels: key "" must be 1..256 bytes`},
		{func(s *Spec) { s.Options["k"] = strings.Repeat("v", 1025) }, `driver options: value of "k" is 1025 bytes: at most 1024`},
		{func(s *Spec) { s.IPv4, s.IPv6 = false, false }, "neither IPv4 nor IPv6"},
		{func(s *Spec) {
			for i := range MaxPools {
				s.Pools = append(s.Pools, Pool{Subnet: netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 51, 100, byte(i)}), 32)})
			}
		}, "18 IPAM pools: at most 16"},
	} {
		s, err := FromInspect(inspect())
		if err != nil {
			t.Fatal(err)
		}
		tc.edit(&s)
		if err := s.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate: %v, want an error containing %q", err, tc.want)
		}
		if _, err := s.Encode(); err == nil {
			t.Errorf("Encode of an invalid spec (%s) succeeded", tc.want)
		}
	}
}

func TestWireRoundTrip(t *testing.T) {
	s, _ := FromInspect(inspect())
	b, err := s.Encode()
	if err != nil {
		t.Fatal(err)
	}
	s2, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	if d := Diff(&s, &s2); d != nil {
		t.Fatalf("decoded spec differs: %v", d)
	}
	b2, _ := s2.Encode()
	if string(b) != string(b2) {
		t.Fatalf("encoding not canonical:\n%s\n%s", b, b2)
	}
}

func TestDecodeRefuses(t *testing.T) {
	s, _ := FromInspect(inspect())
	good, _ := s.Encode()
	for _, tc := range []struct {
		in   string
		want string
	}{
		{strings.Replace(string(good), `"v":1`, `"v":2`, 1), "version 2, this overlayd reads 1"},
		{strings.Replace(string(good), `"name":`, `"extra":1,"name":`, 1), `unknown field "extra"`},
		{string(good) + "{}", "data after the object"},
		{`{"v":1,"name":"x","ipam":"default","ipv4":true,"pools":[{"subnet":"192.0.2.0/33"}]}`, "network definition"},
		{`{"v":1,"name":"x","ipam":"default"}`, "neither IPv4 nor IPv6"},
		{`{"v":1,"name":"x y","ipam":"default","ipv4":true}`, "is not allowed"},
		{"[", "network definition"},
		{strings.Repeat(" ", MaxWire+1), "at most 16384"},
	} {
		if _, err := Decode([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Decode(%.60q): %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

// Whatever Decode accepts, Encode writes back to bytes that decode to the
// same spec and encode to themselves; nothing panics.
func FuzzDecode(f *testing.F) {
	s, _ := FromInspect(inspect())
	good, _ := s.Encode()
	f.Add(good)
	f.Add([]byte(`{"v":1,"name":"x","ipam":"default","ipv6":true,"pools":[{"subnet":"2001:db8::/64","gw":"2001:db8::1"}]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := Decode(b)
		if err != nil {
			return
		}
		enc, err := s.Encode()
		if err != nil {
			t.Fatalf("decoded spec does not encode: %v", err)
		}
		s2, err := Decode(enc)
		if err != nil {
			t.Fatalf("encoding does not decode: %v\n%s", err, enc)
		}
		if d := Diff(&s, &s2); d != nil {
			t.Fatalf("round trip differs: %v", d)
		}
		enc2, _ := s2.Encode()
		if string(enc) != string(enc2) {
			t.Fatalf("not canonical:\n%s\n%s", enc, enc2)
		}
	})
}
