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
