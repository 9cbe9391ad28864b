package suggest

import "testing"

func TestClosest(t *testing.T) {
	names := []string{"vni", "encrypted", "mtu", "com.docker.network.driver.mtu"}
	for _, tc := range []struct{ in, want string }{
		{"encrypt", "encrypted"},
		{"Encrypted", "encrypted"},
		{"vnid", "vni"},
		{"com.docker.network.driver.mtuu", "com.docker.network.driver.mtu"},
		{"subnet", ""},
		{"", ""},
	} {
		if got := Closest(tc.in, names); got != tc.want {
			t.Errorf("Closest(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestDistance(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		d    int
	}{{"", "", 0}, {"abc", "", 3}, {"kitten", "sitting", 3}, {"vni", "vnid", 1}} {
		if got := Distance(tc.a, tc.b); got != tc.d {
			t.Errorf("Distance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.d)
		}
	}
}
