package docker

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// netsyncLab starts n engines whose overlayds join one cluster with
// networks defined once on.
func netsyncLab(t *testing.T, n int) (*lab, []*engine, string) {
	t.Helper()
	l := newLab(t)
	es := l.addEngines(n)
	key := filepath.Join(l.dir, "cluster.key")
	if err := os.WriteFile(key, clusterKey(), 0o600); err != nil {
		t.Fatal(err)
	}
	for i, e := range es {
		e.startOverlayd("--join", es[(i+1)%n].addr.String(), "--secret-file", key, "--netsync", "on",
			"--metrics-addr", netsyncMetricsAddr)
	}
	for _, e := range es {
		e.waitAlive(n)
	}
	return l, es, key
}

// netsyncMetricsAddr is where the lab's overlayds serve their metrics,
// each on its engine namespace's loopback.
const netsyncMetricsAddr = "127.0.0.1:9447"

// metric is the value of the sample named series (its whole name with
// labels, as the exposition writes it) of the engine's overlayd, or "".
func (e *engine) metric(series string) string {
	e.t.Helper()
	out, err := e.in(busyboxBinary, "wget", "-qO-", "http://"+netsyncMetricsAddr+"/metrics")
	if err != nil {
		e.t.Fatalf("engine %s: scrape: %v: %s", e.name, err, out)
	}
	for _, l := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// hasNetwork reports whether the engine has a network of that name.
func (e *engine) hasNetwork(name string) bool {
	out, err := e.docker("network", "ls", "-q", "--filter", "name=^"+name+"$")
	return err == nil && strings.TrimSpace(out) != ""
}

// waitNetwork waits until the engine has (want) or lacks (!want) the
// network and returns how long that took.
func (e *engine) waitNetwork(name string, want bool, within time.Duration) time.Duration {
	e.t.Helper()
	start := time.Now()
	for e.hasNetwork(name) != want {
		if time.Since(start) > within {
			st, _ := e.ovd.status()
			e.t.Fatalf("engine %s: network %s present=%v after %v, want %v\nstatus: %.3000s\nlog:\n%s", e.name, name, !want, within, want, st, e.ovd.logTail(30))
		}
		time.Sleep(50 * time.Millisecond)
	}
	return time.Since(start)
}

// netsyncView is the netsync section of overlayd status, as the tests
// read it.
type netsyncView struct {
	Driver      string
	EngineCalls uint64 `json:"engine_calls"`
	Entries     []struct {
		Name string
		Live bool
	}
	Conflicts []struct {
		Name        string
		Differences []string
	}
	Kept []struct {
		Name       string
		Containers int
	}
	Elsewhere []struct {
		Name       string
		Host       string
		Containers int
	}
}

// netsyncStatus is the netsync section of the engine's overlayd status
// (ok false when the status has none or cannot be read).
func (e *engine) netsyncStatus() (v netsyncView, raw string, ok bool) {
	out, err := e.ovd.status()
	if err != nil {
		return v, err.Error(), false
	}
	var parsed struct{ NetSync *netsyncView }
	if err := json.Unmarshal([]byte(out), &parsed); err != nil || parsed.NetSync == nil {
		return v, out, false
	}
	return *parsed.NetSync, out, true
}

// waitNetsyncStatus polls the netsync status until ok holds.
func (e *engine) waitNetsyncStatus(what string, within time.Duration, ok func(v netsyncView) bool) {
	e.t.Helper()
	deadline := time.Now().Add(within)
	for {
		v, raw, got := e.netsyncStatus()
		if got && ok(v) {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("engine %s: %s not in the status after %v: %.3000s", e.name, what, within, raw)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// partition cuts (down) or heals (up) the engine's link to the lab's
// switch.
func (l *lab) partition(e *engine, cut bool) {
	l.t.Helper()
	link, err := l.sw.nl.LinkByName("sw-" + e.name)
	if err != nil {
		l.t.Fatal(err)
	}
	if cut {
		err = l.sw.nl.LinkSetDown(link)
	} else {
		err = l.sw.nl.LinkSetUp(link)
	}
	if err != nil {
		l.t.Fatal(err)
	}
}

// TestNetworksDefinedOnce is the story on three engines and a
// fourth that joins later: a network created on A only appears on B and
// C, with A's settings, and containers on each reach each other over it;
// D gets it when it joins; docker network rm on A removes it on B and D
// (idle) and keeps it on C while C's container uses it (reported), then
// removes it there too; a partitioned host keeps its replica through a
// removal and removes it on heal, resurrecting nothing; a conflicting
// network made by hand is left alone and reported.
func TestNetworksDefinedOnce(t *testing.T) {
	l, es, key := netsyncLab(t, 3)
	a, b, c := es[0], es[1], es[2]
	calls := func(e *engine) uint64 {
		v, raw, ok := e.netsyncStatus()
		if !ok {
			t.Fatalf("engine %s: no netsync status: %.2000s", e.name, raw)
		}
		return v.EngineCalls
	}
	before := []uint64{calls(a), calls(b), calls(c)}
	a.createNetwork("overlayd", "ov", "--ipam-driver", "overlayd", "-o", "vni=4500", "--subnet", "192.0.2.0/24",
		"--label", "com.example.team=blue", "--internal")
	for i, e := range []*engine{b, c} {
		took := e.waitNetwork("ov", true, 10*time.Second)
		t.Logf("engine %s: network ov (created on %s) here after %v", e.name, a.name, took.Round(time.Millisecond))
		// The replica's own event reads the engine once more: wait for
		// it (the entry is adopted) before counting.
		e.waitNetsyncStatus("ov adopted", 10*time.Second, func(v netsyncView) bool {
			return len(v.Entries) == 1 && v.Entries[0].Live
		})
		t.Logf("engine %s: %d Engine API requests by netsync from the create on %s to the replica (%s: %d)",
			e.name, calls(e)-before[i+1], a.name, a.name, calls(a)-before[0])
		for _, f := range []struct{ format, want string }{
			{"{{.Driver}}", "overlayd"},
			{"{{index .Options \"vni\"}}", "4500"},
			{"{{.IPAM.Driver}}", "overlayd"},
			{"{{range .IPAM.Config}}{{.Subnet}}{{end}}", "192.0.2.0/24"},
			{"{{.Internal}}", "true"},
			{"{{index .Labels \"com.example.team\"}}", "blue"},
		} {
			if got := e.must("network", "inspect", "-f", f.format, "ov"); got != f.want {
				t.Errorf("engine %s: network ov %s = %q, want %q (as created on %s)", e.name, f.format, got, f.want, a.name)
			}
		}
	}
	a.run("a1", "ov", "")
	b.run("b1", "ov", "")
	c.run("c1", "ov", "")
	// A container on each host pings the others.
	ctrs := []struct {
		e *engine
		c string
	}{{a, "a1"}, {b, "b1"}, {c, "c1"}}
	for _, src := range ctrs {
		for _, dst := range ctrs {
			if src != dst {
				src.e.mustPing(src.c, dst.e.addrOn(dst.c, "ov"))
			}
		}
	}

	// A fourth host joins later and gets every network.
	d := l.addEngine("h4", 4)
	d.startOverlayd("--join", a.addr.String(), "--secret-file", key, "--netsync", "on")
	took := d.waitNetwork("ov", true, 20*time.Second)
	t.Logf("engine %s (joined later): network ov here %v after its overlayd started", d.name, took.Round(time.Millisecond))

	// rm on A while C uses it: gone on A, B and D once idle there; kept
	// on C (reported) until its container goes.
	a.must("rm", "-f", "a1")
	b.must("rm", "-f", "b1")
	a.must("network", "rm", "ov")
	for _, e := range []*engine{b, d} {
		took := e.waitNetwork("ov", false, 10*time.Second)
		t.Logf("engine %s: network ov (removed on %s) gone after %v", e.name, a.name, took.Round(time.Millisecond))
	}
	c.waitNetsyncStatus("ov kept (1 container)", 10*time.Second, func(v netsyncView) bool {
		return len(v.Kept) == 1 && v.Kept[0].Name == "ov" && v.Kept[0].Containers == 1
	})
	if !c.hasNetwork("ov") {
		t.Fatal("engine h3: ov removed while c1 uses it")
	}
	// The host where it was removed reports where it is still used.
	a.waitNetsyncStatus("ov still used on h3", 10*time.Second, func(v netsyncView) bool {
		return len(v.Elsewhere) == 1 && v.Elsewhere[0].Name == "ov" && v.Elsewhere[0].Host == c.name && v.Elsewhere[0].Containers == 1
	})
	if !strings.Contains(a.ovd.logTail(400), "event=netsync_used_elsewhere") {
		t.Error("engine h1: no event=netsync_used_elsewhere logged")
	}
	c.must("rm", "-f", "c1")
	c.waitNetwork("ov", false, 10*time.Second)
	if a.hasNetwork("ov") {
		t.Fatal("engine h1: ov came back")
	}

	// A partition during the removal: D keeps p1 (it never hears the
	// removal), then removes it on heal; p1 comes back nowhere.
	a.createNetwork("overlayd", "p1", "-o", "vni=4501", "--subnet", "192.0.2.0/26")
	for _, e := range []*engine{b, c, d} {
		e.waitNetwork("p1", true, 10*time.Second)
	}
	l.partition(d, true)
	a.must("network", "rm", "p1")
	b.waitNetwork("p1", false, 10*time.Second)
	c.waitNetwork("p1", false, 10*time.Second)
	if !d.hasNetwork("p1") {
		t.Fatal("engine h4, partitioned, lost p1 without hearing its removal")
	}
	l.partition(d, false)
	took = d.waitNetwork("p1", false, 30*time.Second)
	t.Logf("engine %s: p1 removed %v after the partition healed", d.name, took.Round(time.Millisecond))
	for _, e := range []*engine{a, b, c} {
		if e.hasNetwork("p1") {
			t.Fatalf("engine %s: p1 resurrected after the heal", e.name)
		}
	}

	// An overlayd restart: B learns what was created while it was down,
	// and still knows its replicas after it (the ledger is in the state
	// file): they go when removed on A. A lost ledger would make them
	// look like B's own networks, kept for good.
	a.createNetwork("overlayd", "r1", "-o", "vni=4504", "--subnet", "192.0.2.64/26")
	b.waitNetwork("r1", true, 10*time.Second)
	if err := b.ovd.stop(); err != nil {
		t.Fatal(err)
	}
	a.createNetwork("overlayd", "r2", "-o", "vni=4505", "--subnet", "192.0.2.128/26")
	if err := b.ovd.start(); err != nil {
		t.Fatal(err)
	}
	took = b.waitNetwork("r2", true, 20*time.Second)
	t.Logf("engine %s: r2, created while its overlayd was stopped, here %v after its restart", b.name, took.Round(time.Millisecond))
	a.must("network", "rm", "r1")
	a.must("network", "rm", "r2")
	b.waitNetwork("r1", false, 10*time.Second)
	b.waitNetwork("r2", false, 10*time.Second)

	// A conflicting network made by hand on B (while B was cut off) is
	// left alone and reported; the others get A's definition.
	l.partition(b, true)
	b.createNetwork("overlayd", "conf", "-o", "vni=4502", "--subnet", "198.51.100.128/26")
	// A's create is the later act (stamps are the engines' creation
	// times): the cluster's definition once B is back.
	a.createNetwork("overlayd", "conf", "-o", "vni=4503", "--subnet", "203.0.113.192/26")
	c.waitNetwork("conf", true, 10*time.Second)
	l.partition(b, false)
	b.waitNetsyncStatus("the conflict on conf", 30*time.Second, func(v netsyncView) bool {
		for _, c := range v.Conflicts {
			if c.Name == "conf" && slices.ContainsFunc(c.Differences, func(d string) bool { return strings.Contains(d, "vni=4502} here, {vni=4503} there") }) {
				return true
			}
		}
		return false
	})
	if got := b.metric("overlayd_netsync_conflicts"); got != "1" {
		t.Errorf("engine h2: overlayd_netsync_conflicts %q, want 1", got)
	}
	if got := b.must("network", "inspect", "-f", "{{index .Options \"vni\"}}", "conf"); got != "4502" {
		t.Fatalf("engine h2: its own conf was changed: vni %s", got)
	}
	for _, e := range []*engine{c, d} {
		e.waitNetwork("conf", true, 10*time.Second)
		if got := e.must("network", "inspect", "-f", "{{index .Options \"vni\"}}", "conf"); got != "4503" {
			t.Errorf("engine %s: conf has vni %s, want A's 4503", e.name, got)
		}
	}
	if !strings.Contains(b.ovd.logTail(400), "event=netsync_conflict") {
		t.Error("engine h2: the conflict was not logged with event=netsync_conflict")
	}
}

// TestNetsyncOff: with --netsync off the status has no netsync section
// and the log says so once; each host creates its networks itself, as
// every other test of this suite does.
func TestNetsyncOff(t *testing.T) {
	_, es := joinedPair(t)
	a := es[0]
	if _, raw, ok := a.netsyncStatus(); ok {
		t.Errorf("status has a netsync section with --netsync off: %.2000s", raw)
	}
	if n := strings.Count(a.ovd.logTail(400), "networks defined once are off"); n != 1 {
		t.Errorf("the log says %d times that networks defined once are off, want once", n)
	}
}

// TestComposeNetsync: the compose example on two hosts with networks
// defined once, the two `compose up` racing: both succeed, the network
// compose defines exists once per host with the file's settings (no
// conflict reported), the external one was created on one host only, and
// the containers reach each other over both.
func TestComposeNetsync(t *testing.T) {
	readme := needCompose(t)
	creates := readmeCommands(t, readme, "docker network create ")
	if len(creates) != 1 {
		t.Fatalf("%s: want one docker network create, have %v", readme, creates)
	}
	external := creates[0][len(creates[0])-1]
	_, es, _ := netsyncLab(t, 2)
	for _, e := range es {
		e.linkCompose()
		t.Cleanup(func() { e.compose("down", "--timeout", "1") })
	}
	es[0].must(creates[0][1:]...) // once, on h1
	es[1].waitNetwork(external, true, 10*time.Second)

	errs := make(chan error, len(es))
	for _, e := range es {
		go func() {
			_, err := e.compose("up", "-d")
			if err != nil {
				err = fmt.Errorf("engine %s: %w", e.name, err)
			}
			errs <- err
		}()
	}
	for range es {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for _, e := range es {
		got := e.must("network", "inspect", "-f", `{{.Driver}} {{index .Options "vni"}} {{range .IPAM.Config}}{{.Subnet}}{{end}}`, "demo_backend")
		if want := "overlayd 4243 192.0.2.128/25"; got != want {
			t.Errorf("engine %s: demo_backend: %q, want %q", e.name, got, want)
		}
		if v, raw, ok := e.netsyncStatus(); !ok || len(v.Conflicts) != 0 {
			t.Errorf("engine %s: conflicts after the racing compose ups: %.2000s", e.name, raw)
		}
	}
	b := es[1].must("inspect", "-f", `{{(index .NetworkSettings.Networks "demo_backend").IPAddress}}`, "demo-app-1")
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := es[0].compose("exec", "-T", "app", "ping", "-c", "1", "-W", "1", b)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("h1's app does not reach h2's %s over demo_backend within 30 s: %v", b, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
