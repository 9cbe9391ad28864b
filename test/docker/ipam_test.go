package docker

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The cluster IPAM with real engines: two standalone dockerds, each with a
// legacy overlayd, the two overlayds joined; networks created with
// `--ipam-driver overlayd` and no --ip-range on both.

const (
	ipamNet    = "inet"
	ipamSubnet = "192.0.2.0/24"
	ipamVNI    = "4701"
)

// ipamPair starts engines h1 and h2 with overlayds that join each other,
// waits until each sees the other, and creates the IPAM network on both.
func ipamPair(t *testing.T) (*lab, []*engine) {
	t.Helper()
	l, es := joinedPair(t)
	for _, e := range es {
		start := time.Now()
		// --internal: no docker_gwbridge, whose /28 (the lab's default
		// address pool) holds 13 containers, not 25.
		e.must("network", "create", "-d", "overlayd", "--ipam-driver", "overlayd", "--internal", "-o", "vni="+ipamVNI, "--subnet", ipamSubnet, ipamNet)
		timing(t, "docker network create --ipam-driver overlayd on "+e.name, time.Since(start))
	}
	return l, es
}

// joinedPair starts engines h1 and h2 with legacy overlayds that join each
// other (one cluster key) and waits until each sees the other.
func joinedPair(t *testing.T) (*lab, []*engine) {
	t.Helper()
	return joinedPairWith(t, nil)
}

// joinedPairWith is joinedPair with prepare run on each engine before its
// overlayd starts.
func joinedPairWith(t *testing.T, prepare func(*engine)) (*lab, []*engine) {
	t.Helper()
	l := newLab(t)
	es := l.addEngines(2)
	if prepare != nil {
		for _, e := range es {
			prepare(e)
		}
	}
	key := filepath.Join(l.dir, "cluster.key")
	if err := os.WriteFile(key, clusterKey(), 0o600); err != nil {
		t.Fatal(err)
	}
	for i, e := range es {
		e.startOverlayd("--join", es[1-i].addr.String(), "--secret-file", key)
	}
	for _, e := range es {
		e.waitAlive(2)
	}
	return l, es
}

// waitAlive waits until the engine's overlayd sees n members alive.
func (e *engine) waitAlive(n int) {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := e.ovd.status()
		var parsed struct {
			Cluster struct {
				Members []struct{ State string }
			}
		}
		alive := 0
		if err == nil && json.Unmarshal([]byte(st), &parsed) == nil {
			for _, m := range parsed.Cluster.Members {
				if m.State == "alive" {
					alive++
				}
			}
		}
		if alive == n {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("engine %s: overlayd does not see %d members alive: %v\n%s", e.name, n, err, st)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ipamGateway returns the gateway of the engine's overlayd's IPAM pool
// (its status), and fails the test if it shows a network definition
// contradicted by the other host.
func (e *engine) ipamGateway() string {
	e.t.Helper()
	raw, err := e.ovd.status()
	if err != nil {
		e.t.Fatalf("engine %s: overlayd status: %v\n%s", e.name, err, raw)
	}
	var st struct {
		IPAM struct {
			Pools []struct {
				Prefix, Gateway string
			}
		}
		Driver struct {
			Networks []struct {
				DefinitionConflicts []any `json:"definition_conflicts"`
			}
		}
	}
	if err := json.Unmarshal([]byte(raw), &st); err != nil {
		e.t.Fatalf("engine %s: overlayd status: %v", e.name, err)
	}
	for _, n := range st.Driver.Networks {
		if len(n.DefinitionConflicts) > 0 {
			e.t.Errorf("engine %s: the other host defines the network differently: %v", e.name, n.DefinitionConflicts)
		}
	}
	for _, p := range st.IPAM.Pools {
		if p.Prefix == ipamSubnet {
			return p.Gateway
		}
	}
	return ""
}

// ipOf returns container c's address on the IPAM network.
func (e *engine) ipOf(c string) netip.Addr {
	e.t.Helper()
	s := e.must("inspect", "-f", `{{(index .NetworkSettings.Networks "`+ipamNet+`").IPAddress}}`, c)
	a, err := netip.ParseAddr(s)
	if err != nil {
		e.t.Fatalf("engine %s: container %s has address %q on %s", e.name, c, s, ipamNet)
	}
	return a
}

// runMany starts n containers name0..name{n-1} on the IPAM network of each
// engine, the engines in parallel; it fails the test on any error.
func runMany(t *testing.T, es []*engine, prefix string, n int, extra ...string) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(es))
	for i, e := range es {
		wg.Go(func() {
			for j := range n {
				args := append([]string{"run", "-d", "--name", fmt.Sprintf("%s-%s%d", e.name, prefix, j), "--network", ipamNet, "--stop-timeout", "1"}, extra...)
				if _, err := e.docker(append(append(args, image), sleeper...)...); err != nil {
					errs[i] = err
					return
				}
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("engine %s: %v", es[i].name, err)
		}
	}
}

// addresses returns the IPAM network's address of every container of the
// engines whose name starts with the engine's name, by container.
func addresses(t *testing.T, es []*engine) map[string]netip.Addr {
	t.Helper()
	out := map[string]netip.Addr{}
	for _, e := range es {
		for _, c := range strings.Fields(e.must("ps", "--format", "{{.Names}}")) {
			out[e.name+"/"+c] = e.ipOf(c)
		}
	}
	return out
}

// checkDistinct fails t if two containers have one address, or one has an
// address outside the subnet or the gateway's.
func checkDistinct(t *testing.T, addrs map[string]netip.Addr) {
	t.Helper()
	subnet := netip.MustParsePrefix(ipamSubnet)
	by := map[netip.Addr][]string{}
	for c, a := range addrs {
		by[a] = append(by[a], c)
		if !subnet.Contains(a) || a == subnet.Addr() || a == subnet.Addr().Next() {
			t.Errorf("container %s has %s: not an address a container may have in %s", c, a, subnet)
		}
	}
	for a, cs := range by {
		if len(cs) > 1 {
			sort.Strings(cs)
			t.Errorf("address %s is held by %d containers: %v", a, len(cs), cs)
		}
	}
}

// pingAll pings, from every container of from, every address of to (one
// docker exec per container, a shell loop inside); it returns the pairs
// that did not answer.
func pingAll(from *engine, fromCtrs []string, to []netip.Addr) []string {
	var list []string
	for _, a := range to {
		list = append(list, a.String())
	}
	script := fmt.Sprintf(`for ip in %s; do ping -c 1 -W 2 $ip >/dev/null || ping -c 1 -W 2 $ip >/dev/null || echo "FAIL $ip"; done`, strings.Join(list, " "))
	var mu sync.Mutex
	var failed []string
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for _, c := range fromCtrs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			out, err := from.docker("exec", c, "sh", "-c", script)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed = append(failed, fmt.Sprintf("%s: %v", c, err))
			}
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "FAIL ") {
					failed = append(failed, c+" -> "+strings.TrimPrefix(l, "FAIL "))
				}
			}
		})
	}
	wg.Wait()
	return failed
}

var ipamCallRE = regexp.MustCompile(`msg="plugin call" method=IpamDriver\.(\w+)`)
var ipamReqRE = regexp.MustCompile(`msg="ipam request" .*\bcall=(\w+)`)

// ipamCalls counts the IpamDriver calls in log (overlayd at debug), by
// call, and returns the RequestAddress/ReleaseAddress lines with an
// address (replays and releases).
func ipamCalls(log string) (map[string]int, []string) {
	counts := map[string]int{}
	var withAddr []string
	for _, l := range strings.Split(log, "\n") {
		if m := ipamCallRE.FindStringSubmatch(l); m != nil {
			counts[m[1]]++
		}
		if m := ipamReqRE.FindStringSubmatch(l); m != nil && (m[1] == "RequestAddress" && !strings.Contains(l, `address=""`) || m[1] == "ReleaseAddress") {
			withAddr = append(withAddr, l)
		}
	}
	return counts, withAddr
}

// TestIPAMTwoEngines: two standalone engines, `docker network create -d
// overlayd --ipam-driver overlayd -o vni=... --subnet 192.0.2.0/24` on
// both (no --ip-range), 20 containers on each: all 40 addresses distinct,
// the same gateway on both, and every container of each host pings every
// container of the other (all 800 cross-host pairs). `docker run --ip X`
// is honoured when X is free and refused naming the host that holds it
// when not. Restarting dockerd (running containers with a restart policy)
// and SIGKILLing overlayd: afterwards every running container's address is
// allocated to it (another container asking for it is refused) and new
// containers get none of them. What the engine sent the IPAM (capabilities
// asked, replays) is logged for the README.
func TestIPAMTwoEngines(t *testing.T) {
	_, es := ipamPair(t)
	h1, h2 := es[0], es[1]
	// The same gateway on both: dockerd shows only what was given in
	// `network inspect`, so ask overlayd (its IPAM's pool, and no host
	// contradicting the other's network definition, gateway included).
	for _, e := range es {
		if d := e.must("network", "inspect", "-f", "{{.IPAM.Driver}} {{range .IPAM.Config}}{{.Subnet}}{{end}}", ipamNet); d != "overlayd "+ipamSubnet {
			t.Fatalf("engine %s: IPAM of the network %q, want overlayd and %s", e.name, d, ipamSubnet)
		}
		if gw := e.ipamGateway(); gw != "192.0.2.1" {
			t.Fatalf("engine %s: overlayd's pool %s has gateway %q, want 192.0.2.1", e.name, ipamSubnet, gw)
		}
	}

	start := time.Now()
	runMany(t, es, "c", 20, "--restart", "always")
	timing(t, "40 containers started (20 per engine, engines in parallel)", time.Since(start))
	addrs := addresses(t, es)
	if len(addrs) != 40 {
		t.Fatalf("%d containers running, want 40", len(addrs))
	}
	checkDistinct(t, addrs)
	per := map[*engine][]string{}
	var on [2][]netip.Addr
	for i, e := range es {
		for j := range 20 {
			c := fmt.Sprintf("%s-c%d", e.name, j)
			per[e] = append(per[e], c)
			on[i] = append(on[i], addrs[e.name+"/"+c])
		}
	}
	start = time.Now()
	for i, e := range es {
		if failed := pingAll(e, per[e], on[1-i]); len(failed) > 0 {
			t.Fatalf("%d of 400 pings from %s's containers to %s's unanswered: %v", len(failed), e.name, es[1-i].name, failed[:min(10, len(failed))])
		}
	}
	timing(t, "800 cross-host pings (every pair, both ways)", time.Since(start))
	// Each host's containers reach the gateway, 192.0.2.1 on both (the
	// sandbox's bridge), and the hosts agree on the network's definition.
	for _, e := range es {
		if failed := pingAll(e, per[e][:1], []netip.Addr{netip.MustParseAddr("192.0.2.1")}); len(failed) > 0 {
			t.Errorf("engine %s: the gateway does not answer: %v", e.name, failed)
		}
		e.ipamGateway()
	}

	// --ip: a free address is honoured, on either host; a taken one is
	// refused, naming the host that holds it.
	free := freeAddr(addrs)
	h2.run("h2-fixed", ipamNet, free.String())
	if got := h2.ipOf("h2-fixed"); got != free {
		t.Fatalf("docker run --ip %s on h2 got %s", free, got)
	}
	taken := addrs["h1/h1-c3"]
	out, err := h2.docker("run", "-d", "--name", "h2-clash", "--network", ipamNet, "--ip", taken.String(), image, "true")
	if err == nil || !strings.Contains(out, taken.String()) || !strings.Contains(out, "h1") {
		t.Fatalf("docker run --ip %s (h1's h1-c3 holds it) on h2: %v\n%s\nwant a refusal naming h1", taken, err, out)
	}
	t.Logf("--ip of another host's container, refused: %s", lastLine(out))
	h2.dockerQuiet("rm", "-f", "h2-clash")
	out, err = h2.docker("run", "-d", "--name", "h2-clash2", "--network", ipamNet, "--ip", addrs["h2/h2-c0"].String(), image, "true")
	if err == nil || !strings.Contains(out, addrs["h2/h2-c0"].String()) {
		t.Fatalf("docker run --ip of h2's own h2-c0 on h2: %v\n%s\nwant a refusal naming the address", err, out)
	}
	t.Logf("--ip of a container on the same host, refused: %s", lastLine(out))
	h2.dockerQuiet("rm", "-f", "h2-clash2")

	// dockerd restart on h1 with its containers running (restart policy
	// always: dockerd stops them, then starts them again).
	mark := len(h1.ovd.logTail(1 << 30))
	h1.restartDockerd()
	if err := waitRunning(h1, per[h1]); err != nil {
		t.Fatal(err)
	}
	counts, withAddr := ipamCalls(h1.ovd.logTail(1 << 30)[mark:])
	t.Logf("what dockerd %s sent overlayd's IPAM across its restart: %v; requests and releases naming an address: %d", engineVersion(h1), counts, len(withAddr))
	for _, l := range withAddr[:min(6, len(withAddr))] {
		t.Logf("  %s", l)
	}
	addrs = addresses(t, es)
	checkDistinct(t, addrs)

	// SIGKILL of h2's overlayd, restarted at once (as systemd would).
	h2.ovd.cmd.Process.Signal(syscall.SIGKILL)
	<-h2.ovd.done
	h2.ovd.log.Close()
	if err := h2.ovd.start(); err != nil {
		t.Fatal(err)
	}
	h2.waitAlive(2)

	// Every running container's address is still allocated to it: another
	// container asking for it is refused, on its host and on the other.
	for c, a := range addrs {
		if !strings.HasSuffix(c, "-c5") && !strings.HasSuffix(c, "-fixed") {
			continue
		}
		for _, e := range es {
			name := fmt.Sprintf("%s-steal%d", e.name, a.As4()[3])
			out, err := e.docker("run", "-d", "--name", name, "--network", ipamNet, "--ip", a.String(), image, "true")
			e.dockerQuiet("rm", "-f", name)
			if err == nil {
				t.Errorf("%s: --ip %s (held by %s) was handed out again after the restarts", e.name, a, c)
			}
			_ = out
		}
	}
	// New containers on both: none gets an address in use.
	runMany(t, es, "new", 5)
	all := addresses(t, es)
	if len(all) != 51 {
		t.Errorf("%d containers running, want 51 (40 + 1 fixed + 10 new)", len(all))
	}
	checkDistinct(t, all)
	// And the network still carries traffic both ways.
	if failed := pingAll(h1, []string{"h1-new0"}, []netip.Addr{all["h2/h2-new0"], all["h2/h2-c5"]}); len(failed) > 0 {
		t.Errorf("after the restarts: %v", failed)
	}
	if failed := pingAll(h2, []string{"h2-new0"}, []netip.Addr{all["h1/h1-new0"], all["h1/h1-c5"]}); len(failed) > 0 {
		t.Errorf("after the restarts: %v", failed)
	}
	h2log := h2.ovd.logTail(1 << 30)
	counts, _ = ipamCalls(h2log)
	t.Logf("IpamDriver calls overlayd on h2 saw in all (engine %s): %v", engineVersion(h2), counts)
	for _, call := range []string{"RequestPool", "RequestAddress"} {
		if l := grepLines(h2log, `msg="ipam request" component=ipam call=`+call+" "); l != "" {
			t.Logf("what the engine sends: %s", strings.SplitN(l, "\n", 2)[0])
		}
	}
}

// freeAddr returns an address of the subnet that no container in addrs
// has, from the top of the subnet.
func freeAddr(addrs map[string]netip.Addr) netip.Addr {
	used := map[netip.Addr]bool{}
	for _, a := range addrs {
		used[a] = true
	}
	for i := 250; ; i-- {
		a := netip.AddrFrom4([4]byte{192, 0, 2, byte(i)})
		if !used[a] {
			return a
		}
	}
}

// waitRunning waits until every container of cs runs on e.
func waitRunning(e *engine, cs []string) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		var down []string
		for _, c := range cs {
			if s, _ := e.docker("inspect", "-f", "{{.State.Status}}", c); s != "running" {
				down = append(down, c+"="+s)
			}
		}
		if len(down) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("engine %s: containers not running 60 s after dockerd's restart: %v", e.name, down)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// engineVersion is the engine's server version.
func engineVersion(e *engine) string {
	v, _ := e.docker("version", "-f", "{{.Server.Version}}")
	return v
}

func lastLine(s string) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	return l[len(l)-1]
}

// TestIPAMRefusedInput: what `docker network create --ipam-driver overlayd`
// and `docker run --ip` print for bad input, through a real engine: each
// refusal names what was wrong, and a refused network leaves nothing
// behind (dockerd lists no network, and the same name and VNI work
// afterwards).
func TestIPAMRefusedInput(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	e.startOverlayd()
	create := func(args ...string) (string, error) {
		return e.docker(append(append([]string{"network", "create", "-d", "overlayd", "--ipam-driver", "overlayd", "-o", "vni=4711"}, args...), "bad")...)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no --subnet", nil, "--subnet is required"},
		{"a gateway that is not the subnet's first address", []string{"--subnet", "192.0.2.0/24", "--gateway", "192.0.2.9"}, "192.0.2.1"},
		{"a subnet too small", []string{"--subnet", "192.0.2.0/31"}, "too small"},
		{"an --ip-range outside the subnet", []string{"--subnet", "192.0.2.0/25", "--ip-range", "192.0.2.128/26"}, "192.0.2.128/26"},
		{"IPv6", []string{"--ipv6", "--subnet", "192.0.2.0/24", "--subnet", "2001:db8::/64"}, "IPv4"},
	} {
		out, err := create(tc.args...)
		t.Logf("%s: %s", tc.name, lastLine(out))
		if err == nil || !strings.Contains(out, tc.want) {
			t.Errorf("%s: %v\n%s\nwant a refusal saying %q", tc.name, err, out, tc.want)
		}
		if contains(e.networks(), "bad") {
			t.Fatalf("%s: the refused network is listed", tc.name)
		}
	}
	e.must("network", "create", "-d", "overlayd", "--ipam-driver", "overlayd", "-o", "vni=4712", "--subnet", "192.0.2.0/24", "good")
	out, err := create("--subnet", "192.0.2.128/25")
	t.Logf("a pool overlapping another: %s", lastLine(out))
	if err == nil || !strings.Contains(out, "overlaps") || !strings.Contains(out, "192.0.2.0/24") {
		t.Errorf("a pool overlapping another overlayd pool: %v\n%s\nwant a refusal naming it", err, out)
	}
	out, err = e.docker("run", "-d", "--name", "far", "--network", "good", "--ip", "203.0.113.200", image, "true")
	t.Logf("--ip outside the subnet: %s", lastLine(out))
	if err == nil {
		t.Errorf("docker run --ip outside the subnet succeeded:\n%s", out)
	}
	out, err = e.docker("run", "-d", "--name", "gw", "--network", "good", "--ip", "192.0.2.1", image, "true")
	t.Logf("--ip of the gateway: %s", lastLine(out))
	if err == nil || !strings.Contains(out, "192.0.2.1") {
		t.Errorf("docker run --ip of the gateway: %v\n%s\nwant a refusal naming it", err, out)
	}
	// Nothing of the refusals stayed: the name and VNI are free.
	e.must("network", "create", "-d", "overlayd", "--ipam-driver", "overlayd", "-o", "vni=4711", "--subnet", "198.51.100.0/24", "bad")
	e.dockerQuiet("rm", "-f", "far", "gw")
	mark := len(e.ovd.logTail(1 << 30))
	e.must("network", "rm", "bad", "good")
	// docker network rm gives the pools back.
	deadline := time.Now().Add(10 * time.Second)
	for {
		counts, _ := ipamCalls(e.ovd.logTail(1 << 30)[mark:])
		if counts["ReleasePool"] == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after docker network rm of two networks, overlayd saw %v, want 2 ReleasePool", counts)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
