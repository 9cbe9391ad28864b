package docker

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// IPv6 with real engines (issue 12): a dual-stack network of two standalone
// engines, each with its own overlayd (legacy plugin, then managed plugin),
// the two overlayds joined in one cluster. Docker 20.10 and 26.1 cannot
// create an IPv6-only network (every network gets an IPv4 pool), so the
// engines' part is dual-stack; the IPv6-only networks are covered by the
// kernel tests of the driver, and on Docker 28 and later (--ipv4=false) by
// TestPluginRequests.
//
// The overlay's addresses are 192.0.2.0/26 and 2001:db8:1::/64: the lab's
// underlay is 198.51.100.0/24 and the engines' own bridges use
// 203.0.113.0/24 (engine_test.go), so no address of the overlay is also one
// of a host's.

const (
	v6Net    = "v6n"
	v6VNI    = "4801"
	v6Subnet = "2001:db8:1::/64"
	v6GW     = "2001:db8:1::1"
	v4Subnet = "192.0.2.0/26"
)

// v6Host is one engine of the dual-stack test and how to reach its overlayd.
type v6Host struct {
	*engine
	driver string // -d of docker network create: overlayd or overlayd:latest
	// status returns `overlayd status --json` of the engine's overlayd.
	status func() (string, error)
	// sandboxCmd runs a command inside the network namespace of the
	// network's sandbox, as the engine's host sees it.
	sandboxCmd func(args ...string) (string, error)
}

func TestIPv6TwoEngines(t *testing.T) {
	t.Run("Legacy", func(t *testing.T) {
		l := newLab(t)
		es := l.addEngines(2)
		key := filepath.Join(l.dir, "cluster.key")
		if err := os.WriteFile(key, clusterKey(), 0o600); err != nil {
			t.Fatal(err)
		}
		var hs []*v6Host
		for i, e := range es {
			o := e.startOverlayd("--join", es[1-i].addr.String(), "--secret-file", key)
			hs = append(hs, &v6Host{engine: e, driver: "overlayd", status: o.status,
				sandboxCmd: func(args ...string) (string, error) {
					files, _ := o.sandboxes()
					if len(files) != 1 {
						return "", fmt.Errorf("sandboxes %v, want one", files)
					}
					return runOut("nsenter", append([]string{"--net=" + filepath.Join(o.netnsDir, files[0]), "--"}, args...)...)
				}})
		}
		for _, e := range es {
			e.waitAlive(2)
		}
		dualStackAcross(t, hs)
		for _, h := range hs {
			h.waitClean(h.ovd)
		}
	})
	t.Run("Managed", func(t *testing.T) {
		l := newLab(t)
		es := l.addEngines(2)
		dir := filepath.Join(l.dir, "plugin")
		buildPluginDir(t, dir)
		key := clusterKey()
		var hs []*v6Host
		var shs []*swarmHost
		for i, e := range es {
			sh := &swarmHost{engine: e}
			shs = append(shs, sh)
			installStandalonePlugin(sh, dir, key, es[1-i].addr.String())
			hs = append(hs, &v6Host{engine: e, driver: pluginRef,
				status: func() (string, error) {
					return sh.inMount(overlayd, "status", "--json", "--control-socket", "/run/docker/plugins/"+sh.pluginID+"/control.sock")
				},
				sandboxCmd: func(args ...string) (string, error) {
					sb := sandboxesIn(sh.mountsUnder(sh.propagatedNetns()), sh.propagatedNetns())
					if len(sb) != 1 {
						return "", fmt.Errorf("sandbox mounts %v, want one", sb)
					}
					return sh.inMount(append([]string{"nsenter", "--net=" + sb[0], "--"}, args...)...)
				}})
		}
		for _, h := range shs {
			eventually(t, 20*time.Second, h.name+": overlayd sees 2 members alive", func() string {
				st, err := h.status()
				if err != nil {
					return err.Error()
				}
				if alive := st.alive(); len(alive) != 2 {
					return fmt.Sprintf("alive: %v", alive)
				}
				return ""
			})
		}
		dualStackAcross(t, hs)
	})
}

// installStandalonePlugin creates and enables the managed plugin on h for a
// standalone engine: scope local, its advertise address, the other host to
// join, the shared cluster key in its state mount.
func installStandalonePlugin(h *swarmHost, dir string, key []byte, join string) {
	h.t.Helper()
	h.installPluginWith(dir, key, "OVERLAYD_ADVERTISE_ADDR="+h.addr.String(), "OVERLAYD_JOIN="+join)
}

// dualStackAcross creates the dual-stack network on both engines, one
// container on each with a given IPv4 and IPv6 address, and requires pings
// across the hosts over both families (and to the IPv6 gateway on the
// local sandbox's bridge); then removes everything.
func dualStackAcross(t *testing.T, hs []*v6Host) {
	for _, h := range hs {
		d := h.createNetwork(h.driver, v6Net, "-o", "vni="+v6VNI, "--ipv6", "--subnet", v4Subnet, "--subnet", v6Subnet)
		timing(t, "docker network create --ipv6 (dual-stack) on "+h.name, d)
	}
	type ctr struct{ name, v4, v6 string }
	cs := []ctr{{"c1", "192.0.2.2", "2001:db8:1::2"}, {"c2", "192.0.2.3", "2001:db8:1::3"}}
	for i, h := range hs {
		c := cs[i]
		h.run(c.name, v6Net, c.v4, "--ip6", c.v6)
		got := h.must("inspect", "-f", `{{with index .NetworkSettings.Networks "`+v6Net+`"}}{{.IPAddress}} {{.GlobalIPv6Address}}/{{.GlobalIPv6PrefixLen}} {{.IPv6Gateway}}{{end}}`, c.name)
		t.Logf("engine %s: %s on %s: %s", h.name, c.name, v6Net, got)
		if want := c.v4 + " " + c.v6 + "/64 " + v6GW; got != want {
			t.Errorf("engine %s: %s has %q on %s, want %q (address, IPv6 address, the IPv6 gateway Join returned)", h.name, c.name, got, v6Net, want)
		}
		if out := h.must("exec", c.name, "ip", "-6", "addr", "show", "dev", "eth0"); !strings.Contains(out, c.v6+"/64") {
			t.Errorf("engine %s: %s's eth0 lacks %s/64:\n%s", h.name, c.name, c.v6, out)
		}
	}
	for i, h := range hs {
		me, peer := cs[i], cs[1-i]
		rtt := h.waitPing(me.name, peer.v6)
		timing(t, fmt.Sprintf("ping -6 RTT %s (%s) -> %s across hosts", me.name, h.name, peer.v6), rtt)
		rtt = h.waitPing(me.name, peer.v4)
		timing(t, fmt.Sprintf("ping RTT %s (%s) -> %s across hosts", me.name, h.name, peer.v4), rtt)
		// The gateway is on the sandbox's bridge of this host.
		h.waitPing(me.name, v6GW)
		// The remote container's IPv6 address is a permanent neighbour of
		// the sandbox (overlayd's, from the peer record), not one learnt.
		out, err := h.sandboxCmd("ip", "-6", "neigh", "show", "nud", "permanent")
		if err != nil || !strings.Contains(out, peer.v6+" ") {
			t.Errorf("engine %s: the sandbox's permanent IPv6 neighbours lack %s (the other host's container): %v\n%s", h.name, peer.v6, err, out)
		}
		t.Logf("engine %s: sandbox IPv6 neighbours: %s", h.name, strings.ReplaceAll(out, "\n", "; "))
		if st, err := h.status(); err != nil || !strings.Contains(st, v6Subnet) || !strings.Contains(st, peer.v6) {
			t.Errorf("engine %s: overlayd status lacks the IPv6 subnet %s or the other host's %s: %v\n%s", h.name, v6Subnet, peer.v6, err, st)
		}
	}
	// c2 leaves: h1's sandbox (c1 still joined) drops its IPv6 neighbour.
	hs[1].must("rm", "-f", cs[1].name)
	eventually(t, 15*time.Second, "h1 drops the IPv6 neighbour of h2's container once it left", func() string {
		out, err := hs[0].sandboxCmd("ip", "-6", "neigh", "show", "nud", "permanent")
		if err != nil {
			return err.Error()
		}
		if strings.Contains(out, cs[1].v6+" ") {
			return "still: " + out
		}
		return ""
	})
	hs[0].must("rm", "-f", cs[0].name)
	for _, h := range hs {
		h.must("network", "rm", v6Net)
	}
}

// TestIPv6RefusedInput: what `docker network create --ipv6` prints for
// IPv6 input overlayd refuses, through a real engine (Docker's own IPAM
// accepts all of these subnets and passes them on: measured with 20.10):
// each refusal reaches the user, names the field (IPv6Data, IPv4Data, the
// mtu option) and what was wrong, and leaves nothing (the name and VNI
// work afterwards).
func TestIPv6RefusedInput(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	o := e.startOverlayd()
	create := func(args ...string) (string, error) {
		return e.docker(append(append([]string{"network", "create", "-d", "overlayd", "-o", "vni=4811", "--ipv6"}, args...), "bad")...)
	}
	for _, tc := range []struct {
		name string
		args []string
		want []string // all must appear in the CLI's message
	}{
		{"a link-local subnet", []string{"--subnet", "192.0.2.0/26", "--subnet", "fe80::/64"}, []string{"IPv6Data", "fe80::/64", "link-local"}},
		{"a prefix longer than /120", []string{"--subnet", "192.0.2.0/26", "--subnet", "2001:db8:2::/124"}, []string{"IPv6Data", "2001:db8:2::/124", "120"}},
		{"an MTU below IPv6's minimum", []string{"-o", "mtu=1200", "--subnet", "192.0.2.0/26", "--subnet", "2001:db8:2::/64"}, []string{"mtu", "1280"}},
		{"two IPv4 subnets with IPv6", []string{"--subnet", "192.0.2.0/26", "--subnet", "192.0.2.64/26", "--subnet", "2001:db8:2::/64"}, []string{"IPv4Data", "IPv6"}},
	} {
		out, err := create(tc.args...)
		t.Logf("%s: %s", tc.name, lastLine(out))
		ok := err != nil
		for _, w := range tc.want {
			ok = ok && strings.Contains(out, w)
		}
		if !ok {
			t.Errorf("%s: %v\n%s\nwant a refusal saying %q", tc.name, err, out, tc.want)
		}
		if contains(e.networks(), "bad") {
			t.Fatalf("%s: the refused network is listed", tc.name)
		}
	}
	if st, err := o.status(); err != nil || hasNumber(st, 4811) {
		t.Errorf("overlayd status after the refusals shows VNI 4811 (or failed): %v\n%s", err, st)
	}
	// Nothing of the refusals stayed: the name and VNI are free.
	e.must("network", "create", "-d", "overlayd", "-o", "vni=4811", "--ipv6", "--subnet", "192.0.2.0/26", "--subnet", "2001:db8:2::/64", "bad")
	e.must("network", "rm", "bad")
	e.waitClean(o)
}

// runOut runs a command on the host and returns its trimmed output.
func runOut(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// hasNumber reports whether n appears in s as a number of its own: a VNI
// in overlayd's status, which holds other numbers (key generations such
// as 12498142991650194029 contain "5019").
func hasNumber(s string, n int) bool {
	return regexp.MustCompile(fmt.Sprintf(`(^|[^0-9])%d([^0-9]|$)`, n)).MatchString(s)
}
