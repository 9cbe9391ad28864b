package docker

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Several engines as several hosts: each dockerd in its own network and mount
// namespace (see lab), plugged into the lab's switch with underlay address
// 198.51.100.N. This is the footing of the swarm suite to come; the test
// here only checks that the engines are up, distinct and isolated.

// addEngines starts engines h1..hn (underlay 198.51.100.1..n), one after the
// other (about a second each: addEngine fails the test through t, which must
// happen on the test's goroutine).
func (l *lab) addEngines(n int) []*engine {
	l.t.Helper()
	var es []*engine
	for i := 1; i <= n; i++ {
		es = append(es, l.addEngine(fmt.Sprintf("h%d", i), i))
	}
	return es
}

// pingUnderlay pings addr from the engine's network namespace (the host, not
// a container) with the host's busybox.
func (e *engine) pingUnderlay(addr string) error {
	out, err := e.in(busyboxBinary, "ping", "-c", "1", "-W", "2", addr)
	if err != nil {
		return fmt.Errorf("ping %s from %s: %v\n%s", addr, e.name, err, out)
	}
	return nil
}

func TestTwoEngines(t *testing.T) {
	l := newLab(t)
	start := time.Now()
	es := l.addEngines(2)
	timing(t, "two engines up (namespaces, dockerd, image)", time.Since(start))

	ids := map[string]string{}
	for _, e := range es {
		info := e.must("info", "--format", "{{.Name}} {{.ID}} {{.DockerRootDir}} {{.ServerVersion}} {{.Swarm.LocalNodeState}}")
		f := strings.Fields(info)
		if len(f) != 5 {
			t.Fatalf("engine %s: docker info: %q", e.name, info)
		}
		t.Logf("engine %s: docker info: %s", e.name, info)
		if f[0] != e.name {
			t.Errorf("engine %s reports name %q (its UTS namespace's hostname should be the engine name)", e.name, f[0])
		}
		if f[2] != e.dir+"/data" {
			t.Errorf("engine %s root dir %s, want %s/data", e.name, f[2], e.dir)
		}
		if f[4] != "inactive" {
			t.Errorf("engine %s swarm state %s, want inactive", e.name, f[4])
		}
		if other, dup := ids[f[1]]; dup {
			t.Errorf("engines %s and %s share the ID %s", other, e.name, f[1])
		}
		ids[f[1]] = e.name
		// Each engine has its own docker0 in its own namespace.
		if links := e.ns.linkNames("docker0"); len(links) != 1 {
			t.Errorf("engine %s: docker0 not in its namespace (%v)", e.name, links)
		}
	}
	// The hosts reach each other over the underlay.
	if err := es[0].pingUnderlay(es[1].addr.String()); err != nil {
		t.Error(err)
	}
	if err := es[1].pingUnderlay(es[0].addr.String()); err != nil {
		t.Error(err)
	}
	// Plugin directories are per engine: a legacy overlayd serving h1 is
	// in h1's /run/docker/plugins only. (Asking h2's dockerd to use it would
	// show the same, after its 15 s of retrying a plugin it cannot find.)
	es[0].startOverlayd()
	for _, e := range es {
		out, err := e.inMount("ls", "/run/docker/plugins")
		if err != nil {
			t.Fatalf("engine %s: ls /run/docker/plugins: %v: %s", e.name, err, out)
		}
		if want := e == es[0]; strings.Contains(out, "overlayd.sock") != want {
			t.Errorf("engine %s sees /run/docker/plugins: %q; want overlayd.sock there: %v", e.name, out, want)
		}
	}
	es[0].createNetwork("overlayd", "iso", "-o", "vni=4501", "--subnet", "192.0.2.0/26")
	es[0].must("network", "rm", "iso")
}

// inMount runs a command in the engine's mount namespace (dockerd's).
func (e *engine) inMount(args ...string) (string, error) {
	out, err := exec.Command("nsenter", append([]string{fmt.Sprintf("--mount=/proc/%d/ns/mnt", e.cmd.Process.Pid), "--"}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}
