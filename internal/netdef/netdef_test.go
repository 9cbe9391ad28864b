package netdef

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func def() Definition {
	return Definition{MTU: 1450, Subnets: []Subnet{{VNI: 5000, Pool: netip.MustParsePrefix("198.51.100.0/24"), Gateway: netip.MustParsePrefix("198.51.100.1/24")}}}
}

// Every field that differs is named, with both values; equal definitions
// have no difference.
func TestDiffNamesEveryDifference(t *testing.T) {
	a, b := def(), def()
	if d := Diff(&a, &b); d != nil || !Equal(&a, &b) {
		t.Fatalf("equal definitions differ: %v", d)
	}
	b.Subnets = slices.Clone(b.Subnets)
	b.Subnets[0].Gateway = netip.MustParsePrefix("198.51.100.254/24")
	b.MTU, b.Encrypted, b.Internal = 1400, true, true
	want := []string{
		"subnets: [VNI 5000 198.51.100.0/24 gw 198.51.100.1] here, [VNI 5000 198.51.100.0/24 gw 198.51.100.254] there",
		"MTU: 1450 here, 1400 there",
		"encrypted: no here, yes there",
		"internal: no here, yes there",
	}
	if d := Diff(&a, &b); !slices.Equal(d, want) || Equal(&a, &b) {
		t.Fatalf("Diff:\n%s\nwant:\n%s", strings.Join(d, "\n"), strings.Join(want, "\n"))
	}
}

func TestValidateNamesTheField(t *testing.T) {
	if d := def(); d.Validate() != nil {
		t.Fatalf("valid definition refused: %v", d.Validate())
	}
	for _, tc := range []struct {
		mutate func(*Definition)
		want   string
	}{
		{func(d *Definition) { d.Subnets = nil }, "0 subnets"},
		{func(d *Definition) { d.MTU = 0 }, "MTU 0"},
		{func(d *Definition) { d.Subnets[0].VNI = 1 << 24 }, "VNI 16777216"},
		{func(d *Definition) { d.Subnets[0].Pool = netip.MustParsePrefix("198.51.100.7/24") }, "not a masked IPv4 prefix"},
		{func(d *Definition) { d.Subnets[0].Pool = netip.MustParsePrefix("2001:db8::/64") }, "not a masked IPv4 prefix"},
		{func(d *Definition) { d.Subnets[0].Gateway = netip.MustParsePrefix("203.0.113.1/24") }, "gateway 203.0.113.1/24 is not an address of pool"},
		{func(d *Definition) { d.Subnets = append(d.Subnets, d.Subnets[0]) }, "VNI 5000 is given twice"},
		{func(d *Definition) {
			d.Subnets = append(d.Subnets, Subnet{VNI: 5001, Pool: netip.MustParsePrefix("198.51.100.128/25")})
		}, "overlaps"},
	} {
		d := def()
		d.Subnets = slices.Clone(d.Subnets)
		tc.mutate(&d)
		if err := d.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate = %v, want an error saying %q", err, tc.want)
		}
	}
}

func dualStack() Definition {
	return Definition{MTU: 1450, Subnets: []Subnet{{VNI: 5000,
		Pool: netip.MustParsePrefix("198.51.100.0/24"), Gateway: netip.MustParsePrefix("198.51.100.1/24"),
		IPv6: []Subnet6{{Pool: netip.MustParsePrefix("2001:db8:1::/64"), Gateway: netip.MustParsePrefix("2001:db8:1::1/64")}}}}}
}

// A definition with IPv6 is valid as one segment; every rule of D1/D4 is
// checked and named.
func TestValidateIPv6(t *testing.T) {
	if d := dualStack(); d.Validate() != nil {
		t.Fatalf("dual-stack definition refused: %v", d.Validate())
	}
	v6only := dualStack()
	v6only.Subnets[0].Pool, v6only.Subnets[0].Gateway = netip.Prefix{}, netip.Prefix{}
	if err := v6only.Validate(); err != nil {
		t.Fatalf("IPv6-only definition refused: %v", err)
	}
	for _, tc := range []struct {
		mutate func(*Definition)
		want   string
	}{
		{func(d *Definition) {
			d.Subnets = append(d.Subnets, Subnet{VNI: 5001, Pool: netip.MustParsePrefix("203.0.113.0/24")})
		}, "2 segments with IPv6 subnets"},
		{func(d *Definition) { d.MTU = 1279 }, "MTU 1279 is below 1280"},
		{func(d *Definition) {
			d.Subnets[0].Pool, d.Subnets[0].Gateway, d.Subnets[0].IPv6 = netip.Prefix{}, netip.Prefix{}, nil
		}, "no IPv4 pool and no IPv6 subnet"},
		{func(d *Definition) { d.Subnets[0].IPv6[0].Pool = netip.MustParsePrefix("fe80::/64") }, "link-local"},
		{func(d *Definition) { d.Subnets[0].IPv6[0].Pool = netip.MustParsePrefix("ff05::/64") }, "multicast"},
		{func(d *Definition) { d.Subnets[0].IPv6[0].Pool = netip.MustParsePrefix("2001:db8::/121") }, "at most 120"},
		{func(d *Definition) { d.Subnets[0].IPv6[0].Pool = netip.MustParsePrefix("::ffff:198.51.100.0/120") }, "IPv4-mapped"},
		{func(d *Definition) { d.Subnets[0].IPv6[0].Pool = netip.MustParsePrefix("2001:db8:1::5/64") }, "not masked"},
		{func(d *Definition) { d.Subnets[0].IPv6[0].Gateway = netip.MustParsePrefix("2001:db8:2::1/64") }, "not an address of pool 2001:db8:1::/64"},
		{func(d *Definition) {
			d.Subnets[0].IPv6 = append(d.Subnets[0].IPv6, Subnet6{Pool: netip.MustParsePrefix("2001:db8:1::/80")})
		}, "overlaps"},
	} {
		d := dualStack()
		d.Subnets = slices.Clone(d.Subnets)
		d.Subnets[0].IPv6 = slices.Clone(d.Subnets[0].IPv6)
		tc.mutate(&d)
		if err := d.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate = %v, want an error saying %q", err, tc.want)
		}
	}
}

// Definitions that differ only in an IPv6 subnet differ, and Diff shows
// both sides' IPv6 subnets.
func TestDiffIPv6(t *testing.T) {
	a, b := dualStack(), dualStack()
	b.Subnets = slices.Clone(b.Subnets)
	b.Subnets[0].IPv6 = []Subnet6{{Pool: netip.MustParsePrefix("2001:db8:2::/64")}}
	want := []string{"subnets: [VNI 5000 198.51.100.0/24 gw 198.51.100.1 2001:db8:1::/64 gw 2001:db8:1::1] here, [VNI 5000 198.51.100.0/24 gw 198.51.100.1 2001:db8:2::/64 gw none] there"}
	if d := Diff(&a, &b); !slices.Equal(d, want) || Equal(&a, &b) {
		t.Fatalf("Diff:\n%s\nwant:\n%s", strings.Join(d, "\n"), strings.Join(want, "\n"))
	}
	c := dualStack()
	if !Equal(&a, &c) {
		t.Fatal("equal dual-stack definitions differ")
	}
}
