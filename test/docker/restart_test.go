package docker

import (
	"os"
	"path/filepath"
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

// TestDockerdKilled: a dockerd that dies under running containers leaves
// its containerd, the shims and the containers running (containerd 2's
// shims, Docker 28.5, also outlive a dockerd stopped in order). The suite
// ends them by PID when the engine stops, and nothing of the engine is left.
func TestDockerdKilled(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	e.startOverlayd()
	e.createNetwork("overlayd", "n1", "-o", "vni=4302", "--subnet", "192.0.2.0/26")
	e.run("c1", "n1", "192.0.2.2")
	e.cmd.Process.Kill()
	<-e.done
	shim := func(p procInfo) bool {
		return strings.HasPrefix(p.comm, "containerd-shim") && p.state != 'Z' && strings.Contains(p.cmdline, e.dir+"/exec/")
	}
	var shims []procInfo
	for _, p := range listProcs() {
		if shim(p) {
			shims = append(shims, p)
		}
	}
	t.Logf("after SIGKILL of dockerd: shims %v", shims)
	if err := e.stopDockerd(10 * time.Second); err != nil {
		t.Error(err)
	}
	for _, p := range listProcs() {
		if p.state != 'Z' && p.pid != e.ovd.cmd.Process.Pid && (p.netns == e.ns.id || strings.Contains(p.cmdline, e.dir+"/")) {
			t.Errorf("engine stopped, still running: %s (pid %d): %s", p.comm, p.pid, p.cmdline)
		}
	}
	// The container's processes (in its own namespaces, with none of the
	// engine's paths on their command line) are gone from its cgroups.
	deadline := time.Now().Add(5 * time.Second)
	for {
		var pids []string
		for _, d := range cgroupDirs(e.cgroupParent) {
			filepath.WalkDir(d, func(path string, de os.DirEntry, err error) error {
				if err == nil && !de.IsDir() && de.Name() == "cgroup.procs" {
					b, _ := os.ReadFile(path)
					pids = append(pids, strings.Fields(string(b))...)
				}
				return nil
			})
		}
		if len(pids) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("engine stopped, processes left in its cgroup %s: %v", e.cgroupParent, pids)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
}
