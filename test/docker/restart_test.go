package docker

import (
	"strings"
	"testing"
	"time"
)

// TestDockerdRestart restarts the engine under running containers: dockerd
// stops them (Leave, DeleteEndpoint) and replays nothing on start, so the
// network must work again when they are started anew — by hand, and by a
// restart policy as dockerd comes up.
func TestDockerdRestart(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	o := e.startOverlayd()

	e.createNetwork("overlayd", "n1", "-o", "vni=4301", "--subnet", "192.0.2.0/26")
	e.run("c1", "n1", "192.0.2.2")
	e.run("c2", "n1", "192.0.2.3")
	e.run("c3", "n1", "192.0.2.4", "--restart", "always")
	e.mustPing("c1", "192.0.2.3")

	e.restartDockerd()

	state := func(c string) string {
		return e.must("inspect", "-f", "{{.State.Status}}", c)
	}
	for _, c := range []string{"c1", "c2"} {
		if s := state(c); s != "exited" {
			t.Errorf("%s after dockerd restart: %s, want exited", c, s)
		}
	}
	// c3 comes back by its restart policy; dockerd may still be starting it.
	deadline := time.Now().Add(20 * time.Second)
	for state("c3") != "running" && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if s := state("c3"); s != "running" {
		t.Fatalf("c3 (--restart always) after dockerd restart: %s, want running", s)
	}
	if !contains(e.networks(), "n1") {
		t.Fatalf("n1 not listed after dockerd restart: %v", e.networks())
	}
	start := time.Now()
	e.must("start", "c1", "c2")
	timing(t, "docker start of 2 containers after a dockerd restart", time.Since(start))
	e.mustPing("c1", "192.0.2.3")
	e.mustPing("c2", "192.0.2.4")
	e.mustPing("c3", "192.0.2.2")
	files, _ := o.sandboxes()
	if len(files) != 1 {
		t.Errorf("sandboxes after restart %v, want one", files)
	}

	e.must("rm", "-f", "c1", "c2", "c3")
	e.must("network", "rm", "n1")
	e.waitClean(o)
	if log := o.logTail(400); strings.Contains(log, "level=ERROR") {
		t.Logf("overlayd logged errors:\n%s", grepLines(log, "level=ERROR"))
	}
}

// grepLines returns the lines of s containing sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
