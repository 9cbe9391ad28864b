package docker

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestLegacyPlugin drives overlayd as a legacy plugin (scope local) of one
// standalone engine. The subtests share the engine and overlayd, and each
// removes what it made and checks that nothing is left.
func TestLegacyPlugin(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	o := e.startOverlayd()

	// dockerd's firewall is in the engine's namespace; overlayd's bridges
	// are in sandboxes of their own, which it does not reach.
	if out, err := e.in("iptables", "-S", "FORWARD"); err == nil {
		t.Logf("engine FORWARD chain: %s", strings.ReplaceAll(out, "\n", "; "))
	}

	t.Run("PingTwoContainers", func(t *testing.T) {
		e.t = t
		defer func() { e.t = l.t }()
		d := e.createNetwork("overlayd", "n1", "-o", "vni=4201", "--subnet", "192.0.2.0/26")
		timing(t, "docker network create (legacy plugin)", d)
		d = e.run("c1", "n1", "192.0.2.2")
		timing(t, "first container start on a network (docker run -d, legacy plugin)", d)
		d = e.run("c2", "n1", "192.0.2.3")
		timing(t, "second container start on the network", d)

		rtt := e.mustPing("c1", "192.0.2.3")
		timing(t, "ping RTT c1 -> c2 (same engine, avg of 3)", rtt)
		e.mustPing("c2", "192.0.2.2")
		e.mustPing("c1", "c2") // Docker's embedded DNS works on the network

		// eth0 on overlayd's network, eth1 on docker_gwbridge for egress.
		if got := e.ifaces("c1"); !contains(got, "eth0") || !contains(got, "eth1") {
			t.Errorf("c1 interfaces %v: want eth0 (n1) and eth1 (docker_gwbridge)", got)
		}
		if mtu := e.must("exec", "c1", "cat", "/sys/class/net/eth0/mtu"); mtu != "1450" {
			t.Errorf("c1 eth0 MTU %s, want 1450 (underlay 1500 - 50)", mtu)
		}
		if st, err := o.status(); err != nil || !hasNumber(st, 4201) {
			t.Errorf("overlayd status does not show n1 (VNI 4201): %v\n%s", err, st)
		}
		files, _ := o.sandboxes()
		if len(files) != 1 {
			t.Fatalf("sandboxes %v, want one for n1", files)
		}
		// dockerd loaded br_netfilter: a bridge in any namespace passes its
		// bridged IPv4 through that namespace's iptables hooks unless the
		// namespace's switch is off. The sandbox has no rules, so overlayd
		// turns it off (the hooks cost throughput and latency,
		// docs/performance.md); a legacy plugin's /proc/sys is writable.
		v, err := sandboxSysctl(filepath.Join(o.netnsDir, files[0]), "net.bridge.bridge-nf-call-iptables")
		if err == nil && v != "0" {
			t.Errorf("sandbox net.bridge.bridge-nf-call-iptables = %q, want 0", v)
		}
		if links := e.overlaydLinks(); len(links) > 0 {
			t.Errorf("overlayd links left in the engine namespace while joined: %v", links)
		}

		e.must("rm", "-f", "c1", "c2")
		e.must("network", "rm", "n1")
		e.waitClean(o)
		if contains(e.networks(), "n1") {
			t.Errorf("n1 still listed after network rm")
		}
	})

	t.Run("ConnectDisconnect", func(t *testing.T) {
		e.t = t
		defer func() { e.t = l.t }()
		e.createNetwork("overlayd", "na", "-o", "vni=4202", "--subnet", "192.0.2.64/26")
		e.createNetwork("overlayd", "nb", "-o", "vni=4203", "--subnet", "192.0.2.128/26")
		e.run("ca", "na", "192.0.2.66")
		e.run("cb", "nb", "192.0.2.130")
		e.mustNotPing("ca", "192.0.2.130")

		start := time.Now()
		e.must("network", "connect", "--ip", "192.0.2.131", "nb", "ca")
		timing(t, "docker network connect", time.Since(start))
		e.mustPing("ca", "192.0.2.130")
		e.mustPing("cb", "192.0.2.131")
		if got := e.ifaces("ca"); len(got) != 4 { // lo, eth0 (na), eth1 (gwbridge), eth2 (nb)
			t.Errorf("ca interfaces after connect: %v, want lo and three eth", got)
		}
		files, _ := o.sandboxes()
		if len(files) != 2 {
			t.Errorf("sandboxes %v, want two (na, nb)", files)
		}

		start = time.Now()
		e.must("network", "disconnect", "nb", "ca")
		timing(t, "docker network disconnect", time.Since(start))
		e.mustNotPing("cb", "192.0.2.131")
		e.mustPing("ca", "192.0.2.66") // own address on na still up
		if got := e.ifaces("ca"); len(got) != 3 {
			t.Errorf("ca interfaces after disconnect: %v, want lo, eth0, eth1", got)
		}
		// Reconnect after disconnect works too (the endpoint was really gone).
		e.must("network", "connect", "--ip", "192.0.2.131", "nb", "ca")
		e.mustPing("ca", "192.0.2.130")

		e.must("rm", "-f", "ca", "cb")
		e.must("network", "rm", "na", "nb")
		e.waitClean(o)
	})

	t.Run("Internal", func(t *testing.T) {
		e.t = t
		defer func() { e.t = l.t }()
		e.createNetwork("overlayd", "ni", "--internal", "-o", "vni=4204", "--subnet", "192.0.2.192/26")
		e.run("ci1", "ni", "192.0.2.194")
		e.run("ci2", "ni", "192.0.2.195")
		e.mustPing("ci1", "192.0.2.195")
		for _, c := range []string{"ci1", "ci2"} {
			got := e.ifaces(c)
			if len(got) != 2 || !contains(got, "eth0") || !contains(got, "lo") {
				t.Errorf("%s interfaces %v: want only lo and eth0 (no docker_gwbridge on an internal network)", c, got)
			}
			if r := e.must("exec", c, "ip", "route"); strings.Contains(r, "default") {
				t.Errorf("%s has a default route on an internal network: %s", c, r)
			}
		}
		e.must("rm", "-f", "ci1", "ci2")
		e.must("network", "rm", "ni")
		e.waitClean(o)
	})

	t.Run("BadOptions", func(t *testing.T) {
		e.t = t
		defer func() { e.t = l.t }()
		for _, tc := range []struct {
			args []string
			want string // the option the error must name
		}{
			{[]string{"-o", "vni=abc"}, "vni"},
			{[]string{"-o", "vni=0"}, "vni"},
			{[]string{"-o", "vni=16777216"}, "vni"},
			{[]string{"-o", "vni=4210", "-o", "com.docker.network.driver.mtu=1"}, "com.docker.network.driver.mtu"},
			{[]string{"-o", "vni=4210", "-o", "com.docker.network.driver.mtu=abc"}, "com.docker.network.driver.mtu"},
			{[]string{"-o", "vni=4210,4211"}, "vni"}, // two VNIs for one subnet
			{[]string{}, "vni"},                      // required outside swarm
			{[]string{"-o", "vni=4210", "-o", "encrypted"}, "encrypted"},
			{[]string{"-o", "vni=4210", "-o", "mtu=abc"}, "mtu"},
			{[]string{"-o", "vnid=4210"}, "vnid"},
		} {
			args := append([]string{"network", "create", "-d", "overlayd", "--subnet", "203.0.113.128/26"}, tc.args...)
			out, err := e.docker(append(args, "bad")...)
			if err == nil {
				t.Errorf("network create %v succeeded, want an error naming %s", tc.args, tc.want)
				e.dockerQuiet("network", "rm", "bad")
				continue
			}
			if !strings.Contains(out, tc.want) {
				t.Errorf("network create %v: error does not name %q: %s", tc.args, tc.want, out)
			} else {
				t.Logf("network create %v: %s", tc.args, out)
			}
			if contains(e.networks(), "bad") {
				t.Errorf("network create %v failed but the network is listed", tc.args)
				e.dockerQuiet("network", "rm", "bad")
			}
			e.waitClean(o)
		}
		// Nothing was left that would stop the same name, subnet and VNI now.
		e.createNetwork("overlayd", "bad", "-o", "vni=4210", "--subnet", "203.0.113.128/26")
		e.run("cg", "bad", "")
		e.must("rm", "-f", "cg")
		e.must("network", "rm", "bad")
		e.waitClean(o)
	})

	// A typo in an option's name, or an MTU the underlay cannot carry, is
	// refused at docker network create with what to give instead; it does
	// not create a network that differs from the one asked for (a clear-text
	// one for -o encrypt).
	t.Run("TypoRefused", func(t *testing.T) {
		e.t = t
		defer func() { e.t = l.t }()
		for _, tc := range []struct {
			args []string
			want []string
		}{
			{[]string{"-o", "vni=5019", "-o", "encrypt"}, []string{`unknown option "encrypt"`, `did you mean "encrypted"?`, "overlayd's options are vni, "}},
			// The engine's eth0 has MTU 1500: at most 1450 over VXLAN.
			{[]string{"-o", "vni=5019", "-o", "mtu=9000"}, []string{"mtu=9000", "the largest MTU is 1450", "has MTU 1500"}},
		} {
			args := append(append([]string{"network", "create", "-d", "overlayd"}, tc.args...), "--subnet", "203.0.113.128/26", "n")
			out, err := e.docker(args...)
			if err == nil {
				t.Errorf("network create %v succeeded, want it refused", tc.args)
				e.dockerQuiet("network", "rm", "n")
				continue
			}
			t.Logf("network create %v: %s", tc.args, out)
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("network create %v: the CLI's error does not say %q: %s", tc.args, w, out)
				}
			}
			if contains(e.networks(), "n") {
				t.Errorf("network create %v failed but network n is listed", tc.args)
				e.dockerQuiet("network", "rm", "n")
			}
			if st, err := o.status(); err != nil || hasNumber(st, 5019) {
				t.Errorf("overlayd status after the refusal (want no VNI 5019): %v\n%s", err, st)
			}
		}
		e.waitClean(o)
	})

	t.Run("RemoveCleansUp", func(t *testing.T) {
		e.t = t
		defer func() { e.t = l.t }()
		e.createNetwork("overlayd", "nr1", "-o", "vni=4221", "--subnet", "203.0.113.192/27")
		e.createNetwork("overlayd", "nr2", "-o", "vni=4222", "--subnet", "203.0.113.224/27")
		e.run("r1", "nr1", "")
		e.run("r2", "nr1", "")
		e.run("r3", "nr2", "")
		e.must("network", "connect", "nr2", "r1")
		files, mounts := o.sandboxes()
		if len(files) != 2 || len(mounts) != 2 {
			t.Errorf("sandboxes %v, mounts %v: want two of each", files, mounts)
		}
		// docker rm -f of running containers, all at once.
		start := time.Now()
		e.must("rm", "-f", "r1", "r2", "r3")
		timing(t, "docker rm -f of 3 running containers", time.Since(start))
		e.waitClean(o)
		start = time.Now()
		e.must("network", "rm", "nr1", "nr2")
		timing(t, "docker network rm of 2 networks", time.Since(start))
		e.waitClean(o)
		for _, n := range []string{"nr1", "nr2"} {
			if contains(e.networks(), n) {
				t.Errorf("%s still listed", n)
			}
		}
	})

	if err := o.stop(); err != nil {
		t.Errorf("overlayd: %v", err)
	}
	t.Logf("overlayd log (tail):\n%s", o.logTail(5))
}
