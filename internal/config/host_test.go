package config

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// CheckHost refuses, in the namespace it runs in, an advertise or gossip
// address no interface has, and an explicit secret file that does not
// exist; each refusal names the setting as given and is one line.
func TestCheckHost(t *testing.T) {
	ns := nstest.NewNS(t, "host")
	nstest.Underlay(t, ns.NL, netip.MustParsePrefix("192.0.2.1/24"), false)
	key := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(key, []byte("k"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "typo.key")
	cases := []struct {
		args []string
		env  map[string]string
		want []string // "" entries: accepted
	}{
		{[]string{"--advertise-addr", "192.0.2.1", "--gossip-addr", "192.0.2.1", "--secret-file", key}, nil, nil},
		{[]string{"--gossip-addr", "0.0.0.0"}, nil, nil},
		{[]string{"--advertise-addr", "203.0.113.9"}, nil, []string{"--advertise-addr 203.0.113.9: not an address of this host (assigned here: 192.0.2.1)"}},
		{nil, map[string]string{"OVERLAYD_GOSSIP_ADDR": "198.51.100.7"}, []string{"$OVERLAYD_GOSSIP_ADDR 198.51.100.7: not an address of this host"}},
		{[]string{"--secret-file", missing}, nil, []string{`--secret-file "` + missing + `": no such file`, "must exist"}},
		{[]string{"--advertise-addr", "203.0.113.9"}, map[string]string{"OVERLAYD_SECRET_FILE": missing},
			[]string{"--advertise-addr 203.0.113.9", `$OVERLAYD_SECRET_FILE "` + missing + `"`}},
	}
	for _, c := range cases {
		st, err := Parse(c.args, env(c.env))
		if err != nil {
			t.Fatalf("Parse(%v): %v", c.args, err)
		}
		err = netnsutil.DoIn(ns.Handle, st.CheckHost)
		if len(c.want) == 0 {
			if err != nil {
				t.Errorf("CheckHost(%v %v): %v", c.args, c.env, err)
			}
			continue
		}
		var inv *Invalid
		if !errors.As(err, &inv) || strings.Contains(err.Error(), "\n") {
			t.Errorf("CheckHost(%v %v) = %v (%T), want one line of *Invalid", c.args, c.env, err, err)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("CheckHost(%v %v) = %q, want it to contain %q", c.args, c.env, err, w)
			}
		}
	}
}
