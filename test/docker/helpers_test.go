package docker

import (
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netns"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// sleeper is a container command that exits at once on SIGTERM (busybox
// sleep as PID 1 ignores it, which would make every stop wait 10 s).
var sleeper = []string{"sh", "-c", `trap "exit 0" TERM; sleep 3600 & wait`}

// timing logs a figure the issue asks for, in a form easy to grep.
func timing(t testing.TB, what string, d time.Duration) {
	t.Helper()
	t.Logf("timing: %s: %v", what, d.Round(10*time.Microsecond))
}

// run starts a detached container on network (with address ip, if given)
// and returns how long `docker run` took.
func (e *engine) run(name, network, ip string, extra ...string) time.Duration {
	e.t.Helper()
	args := []string{"run", "-d", "--name", name, "--network", network, "--stop-timeout", "1"}
	if ip != "" {
		args = append(args, "--ip", ip)
	}
	args = append(args, extra...)
	args = append(append(args, image), sleeper...)
	start := time.Now()
	e.must(args...)
	return time.Since(start)
}

// createNetwork runs `docker network create -d driver` and returns how long
// it took.
func (e *engine) createNetwork(driver, name string, args ...string) time.Duration {
	e.t.Helper()
	start := time.Now()
	e.must(append(append([]string{"network", "create", "-d", driver}, args...), name)...)
	return time.Since(start)
}

var rttRE = regexp.MustCompile(`min/avg/max = [0-9.]+/([0-9.]+)/[0-9.]+ ms`)
var lossRE = regexp.MustCompile(`(\d+) packets transmitted, (\d+) packets received`)

// pingFrom pings dst from inside container c (busybox ping; ping -6 for
// an IPv6 address) and returns the average round-trip time; an error if
// any echo went unanswered.
func (e *engine) pingFrom(c, dst string, count int) (time.Duration, error) {
	args := []string{"exec", c, "ping", "-A", "-c", strconv.Itoa(count), "-W", "2", dst}
	if a, err := netip.ParseAddr(dst); err == nil && a.Is6() {
		args = append(args[:3], append([]string{"-6"}, args[3:]...)...)
	}
	out, err := e.docker(args...)
	if err != nil {
		return 0, fmt.Errorf("ping %s from %s: %w", dst, c, err)
	}
	if m := lossRE.FindStringSubmatch(out); m == nil || m[1] != m[2] {
		return 0, fmt.Errorf("ping %s from %s: lost echoes:\n%s", dst, c, out)
	}
	m := rttRE.FindStringSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("ping %s from %s: no RTT in output:\n%s", dst, c, out)
	}
	ms, _ := strconv.ParseFloat(m[1], 64)
	return time.Duration(ms * float64(time.Millisecond)), nil
}

// mustPing pings dst from c and fails the test if that fails.
func (e *engine) mustPing(c, dst string) time.Duration {
	e.t.Helper()
	rtt, err := e.pingFrom(c, dst, 3)
	if err != nil {
		e.t.Fatalf("engine %s: %v", e.name, err)
	}
	return rtt
}

// mustNotPing checks that one echo from c to dst goes unanswered.
func (e *engine) mustNotPing(c, dst string) {
	e.t.Helper()
	if out, err := e.docker("exec", c, "ping", "-c", "1", "-W", "1", dst); err == nil {
		e.t.Fatalf("engine %s: ping %s from %s succeeded, want failure:\n%s", e.name, dst, c, out)
	}
}

// ifaces lists the network interfaces of container c.
func (e *engine) ifaces(c string) []string {
	e.t.Helper()
	return strings.Fields(e.must("exec", c, "ls", "/sys/class/net"))
}

// networks lists the names of the engine's networks.
func (e *engine) networks() []string {
	e.t.Helper()
	return strings.Fields(e.must("network", "ls", "--format", "{{.Name}}"))
}

// overlaydLinks lists the links overlayd leaves in the engine's namespace
// (host ends "ovd…" of endpoints not yet moved into a container, and their
// sandbox ends "ovs…" should one ever escape the sandbox).
func (e *engine) overlaydLinks() []string { return e.ns.linkNames("ovd", "ovs") }

// waitClean waits up to 10s for the engine to hold no overlayd link and for
// overlayd to hold no sandbox (namespace file or mount), and fails the test
// with what is left otherwise.
func (e *engine) waitClean(o *overlaydProc) {
	e.t.Helper()
	var links, files, mounts []string
	start := time.Now()
	for {
		links = e.overlaydLinks()
		files, mounts = o.sandboxes()
		if len(links)+len(files)+len(mounts) == 0 {
			if d := time.Since(start); d > 500*time.Millisecond {
				e.t.Logf("clean-up took %v to settle", d.Round(time.Millisecond))
			}
			return
		}
		if time.Since(start) > 10*time.Second {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	e.t.Fatalf("engine %s: left behind: links %v, sandbox files %v, sandbox mounts %v", e.name, links, files, mounts)
}

// sandboxSysctl reads a /proc/sys file inside the sandbox namespace mounted at
// path.
func sandboxSysctl(path, key string) (string, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return "", err
	}
	defer ns.Close()
	var val string
	err = netnsutil.DoIn(ns, func() error {
		b, err := os.ReadFile("/proc/sys/" + strings.ReplaceAll(key, ".", "/"))
		val = strings.TrimSpace(string(b))
		return err
	})
	return val, err
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
