package docker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// A lab is one test's world: a "switch" network namespace with a bridge (the
// underlay, 198.51.100.0/24) and engines plugged into it. An engine is a host
// of its own: a dockerd (with its containerd) in its own network namespace
// and mount namespace, so that it never meets a system daemon or another
// engine:
//
//   - network namespace: docker0, docker_gwbridge, the iptables rules and
//     FORWARD policy DROP dockerd installs, and every container's veth stay
//     in it (the root namespace is not touched, so other tests running
//     concurrently do not see dockerd's firewall). overlayd for that engine
//     runs in the same namespace, as it would on a real host.
//   - mount namespace (unshare -m, propagation slave): a fresh sysfs for the
//     namespace with the cgroup tree carried over (dockerd needs both), and
//     the engine's own directory bind-mounted over /run, so that dockerd's
//     hard-wired plugin directory /run/docker/plugins (legacy sockets, and
//     the managed plugins' socket directories) and containerd's shim
//     sockets in /run/containerd are private to the engine. Nothing is
//     created on the host's /run. /etc/docker gets a private directory too
//     (dockerd writes key.json there).
//
// The engine's /run is visible from the host as <engine dir>/run: a legacy
// overlayd for the engine listens on <engine dir>/run/docker/plugins/
// overlayd.sock, which that dockerd sees as /run/docker/plugins/overlayd.sock.
type lab struct {
	t       *testing.T
	dir     string
	sw      *netNS
	engines []*engine
	// registry, if set before addEngine, is a plain-HTTP registry
	// (host:port) the engines may pull from and push to (dockerd trusts
	// only 127.0.0.0/8 without being told).
	registry string
}

var labSeq atomic.Int32

// switchAddr is the switch's address on the underlay 198.51.100.0/24;
// engine N is 198.51.100.N.
const switchAddr = "198.51.100.254/24"

func newLab(t *testing.T) *lab {
	t.Helper()
	prepare(t)
	l := &lab{t: t, dir: filepath.Join(runRoot, strconv.Itoa(int(labSeq.Add(1))))}
	if err := os.MkdirAll(l.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.close)
	sw, err := newNetNS()
	if err != nil {
		t.Fatalf("switch namespace: %v", err)
	}
	l.sw = sw
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "sw0", Flags: net.FlagUp, TxQLen: -1}}
	if err := sw.nl.LinkAdd(br); err != nil {
		t.Fatalf("switch bridge: %v", err)
	}
	a, _ := netlink.ParseAddr(switchAddr)
	if err := sw.nl.AddrAdd(br, a); err != nil {
		t.Fatalf("switch address: %v", err)
	}
	return l
}

func (l *lab) close() {
	for i := len(l.engines) - 1; i >= 0; i-- {
		l.engines[i].close()
	}
	if l.sw != nil {
		l.sw.close()
	}
	if err := removeTree(l.dir); err != nil {
		l.t.Errorf("clean-up of %s: %v", l.dir, err)
	}
	reapOrphans(true)
}

// netNS is an anonymous network namespace held by a handle (no mount: it
// vanishes with the last process and handle), with a netlink handle in it and
// a file for passing it to child processes (nsenter --net=/proc/self/fd/3).
type netNS struct {
	h    netns.NsHandle
	nl   *netlink.Handle
	file *os.File
	id   string // "net:[inode]", as in /proc/PID/ns/net
}

func newNetNS() (*netNS, error) {
	h, err := netnsutil.New()
	if err != nil {
		return nil, err
	}
	n := &netNS{h: h}
	if n.nl, err = netlink.NewHandleAt(h, unix.NETLINK_ROUTE); err != nil {
		h.Close()
		return nil, err
	}
	fd, err := unix.Dup(int(h))
	if err != nil {
		n.close()
		return nil, err
	}
	n.file = os.NewFile(uintptr(fd), "netns")
	if n.id, err = os.Readlink(fmt.Sprintf("/proc/self/fd/%d", int(h))); err != nil {
		n.close()
		return nil, err
	}
	lo, err := n.nl.LinkByName("lo")
	if err == nil {
		err = n.nl.LinkSetUp(lo)
	}
	if err != nil {
		n.close()
		return nil, err
	}
	return n, nil
}

// close deletes the namespace's links (so veths and bridges go now, not when
// the kernel gets round to it) and drops the handles.
func (n *netNS) close() {
	if n.nl != nil {
		if links, err := n.nl.LinkList(); err == nil {
			for _, l := range links {
				if l.Attrs().Name != "lo" {
					n.nl.LinkDel(l)
				}
			}
		}
		n.nl.Close()
	}
	if n.file != nil {
		n.file.Close()
	}
	n.h.Close()
}

// linkNames lists the links of the namespace whose names start with one of
// prefixes.
func (n *netNS) linkNames(prefixes ...string) []string {
	links, err := n.nl.LinkList()
	if err != nil {
		return []string{"(link list failed: " + err.Error() + ")"}
	}
	var out []string
	for _, l := range links {
		for _, p := range prefixes {
			if strings.HasPrefix(l.Attrs().Name, p) {
				out = append(out, l.Attrs().Name)
				break
			}
		}
	}
	return out
}

// engine is one dockerd host of a lab.
type engine struct {
	lab          *lab
	t            *testing.T
	name         string
	dir          string
	ns           *netNS
	addr         netip.Addr
	cgroupParent string
	sock         string // dockerd API socket
	pluginDir    string // the engine's /run/docker/plugins, seen from the host
	cliConfig    string

	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	logFile *os.File
	ovd     *overlaydProc
	rec     *pluginRecorder // between dockerd and ovd, if recordPluginCalls made one
}

// addEngine starts engine number idx (1..) of the lab: namespace, underlay
// address 198.51.100.idx, dockerd, and the busybox image.
func (l *lab) addEngine(name string, idx int) *engine {
	t := l.t
	t.Helper()
	e := &engine{lab: l, t: t, name: name, dir: filepath.Join(l.dir, name),
		addr:      netip.MustParseAddr(fmt.Sprintf("198.51.100.%d", idx)),
		pluginDir: filepath.Join(l.dir, name, "run", "docker", "plugins")}
	e.cgroupParent = fmt.Sprintf("/%s-%s-%s", filepath.Base(runRoot), filepath.Base(l.dir), name)
	e.sock = filepath.Join(e.dir, "docker.sock")
	e.cliConfig = filepath.Join(e.dir, "cli")
	for _, d := range []string{"run/docker/plugins", "etc", "aside", "data", "exec", "cli", "ovd"} {
		if err := os.MkdirAll(filepath.Join(e.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(e.dir, "daemon.json"), []byte("{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	l.engines = append(l.engines, e) // closed by the lab, in reverse order
	ns, err := newNetNS()
	if err != nil {
		t.Fatalf("engine %s namespace: %v", name, err)
	}
	e.ns = ns
	if err := os.WriteFile(filepath.Join(e.dir, "engine.ids"), []byte(ns.id+" "+e.cgroupParent+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := l.plug(e, idx); err != nil {
		t.Fatalf("engine %s underlay: %v", name, err)
	}
	start := time.Now()
	if err := e.startDockerd(); err != nil {
		t.Fatalf("engine %s: %v", name, err)
	}
	t.Logf("engine %s: dockerd ready in %v", name, time.Since(start).Round(time.Millisecond))
	e.importImage()
	return e
}

// plug connects engine e to the switch: eth0 with 198.51.100.idx/24 and a
// default route via the switch.
func (l *lab) plug(e *engine, idx int) error {
	br, err := l.sw.nl.LinkByName("sw0")
	if err != nil {
		return err
	}
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: "sw-" + e.name, MasterIndex: br.Attrs().Index, Flags: net.FlagUp, TxQLen: -1},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(e.ns.h)),
	}
	if err := l.sw.nl.LinkAdd(veth); err != nil {
		return err
	}
	eth0, err := e.ns.nl.LinkByName("eth0")
	if err != nil {
		return err
	}
	a, _ := netlink.ParseAddr(fmt.Sprintf("198.51.100.%d/24", idx))
	a.Flags = unix.IFA_F_NODAD
	if err := e.ns.nl.AddrAdd(eth0, a); err != nil {
		return err
	}
	if err := e.ns.nl.LinkSetUp(eth0); err != nil {
		return err
	}
	gw := netip.MustParsePrefix(switchAddr).Addr()
	return e.ns.nl.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: gw.AsSlice()})
}

// engineScript runs in the engine's new mount and UTS namespaces (already in
// its network namespace) and execs dockerd: $1 hostname, $2 engine dir,
// then dockerd's command line.
const engineScript = `set -e
hostname "$1"
# mount -n: no /run/mount/utab bookkeeping (it would create /run/mount on the
# host before the private /run is in place).
# Private /run (plugin sockets, containerd shim sockets) and /etc/docker.
mount -n --bind "$2/run" /run
if [ -d /etc/docker ]; then mount -n --bind "$2/etc" /etc/docker; fi
# A test's own host resolv.conf, if it wrote one.
if [ -f "$2/resolv.conf" ]; then mount -n --bind "$2/resolv.conf" /etc/resolv.conf; fi
# A sysfs of this network namespace (dockerd reads /sys/class/net), with the
# cgroup tree carried over from the old /sys.
mount -n --rbind /sys/fs/cgroup "$2/aside"
mount -n -t sysfs sysfs /sys
mount -n --rbind "$2/aside" /sys/fs/cgroup
umount -n -l "$2/aside"
exec 3>&-
shift 2
exec "$@"
`

func (e *engine) dockerdArgs() []string {
	args := []string{dockerd,
		"--data-root", filepath.Join(e.dir, "data"),
		"--exec-root", filepath.Join(e.dir, "exec"),
		"-H", "unix://" + e.sock,
		// Also where a real engine serves its API (this dockerd's own
		// /run, see engineScript): the managed plugin mounts it.
		"-H", "unix:///run/docker.sock",
		"--pidfile", filepath.Join(e.dir, "dockerd.pid"),
		"--config-file", filepath.Join(e.dir, "daemon.json"),
		"--cgroup-parent", e.cgroupParent,
		"--bip", "203.0.113.1/26",
		"--default-address-pool", "base=203.0.113.64/26,size=28",
		"--userland-proxy=false",
		"--log-level", "debug",
	}
	if e.lab.registry != "" {
		args = append(args, "--insecure-registry", e.lab.registry)
	}
	return args
}

func (e *engine) startDockerd() error {
	lf, err := os.OpenFile(filepath.Join(e.dir, "dockerd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	e.logFile = lf
	args := append([]string{"--net=/proc/self/fd/3", "--",
		"unshare", "--mount", "--uts", "--propagation", "slave", "--",
		"/bin/sh", "-c", engineScript, "sh", e.name, e.dir}, e.dockerdArgs()...)
	cmd := exec.Command("nsenter", args...)
	if enginePATH != "" {
		// dockerd starts containerd, and containerd the shims, from PATH.
		cmd.Env = append(os.Environ(), "PATH="+enginePATH)
	}
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.ExtraFiles = []*os.File{e.ns.file}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		lf.Close()
		return fmt.Errorf("start dockerd: %w", err)
	}
	e.cmd = cmd
	e.done = make(chan struct{})
	go func() {
		e.waitErr = cmd.Wait()
		close(e.done)
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if err := e.ping(); err == nil {
			return nil
		}
		select {
		case <-e.done:
			return fmt.Errorf("dockerd exited (%v):\n%s", e.waitErr, e.logTail(30))
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("dockerd not ready after 60s:\n%s", e.logTail(30))
		}
	}
}

// ping asks dockerd's /_ping over its socket.
func (e *engine) ping() error {
	c := http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", e.sock)
		}}}
	defer c.CloseIdleConnections()
	resp, err := c.Get("http://docker/_ping")
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/_ping: %s", resp.Status)
	}
	return nil
}

func (e *engine) running() bool {
	if e.done == nil {
		return false
	}
	select {
	case <-e.done:
		return false
	default:
		return true
	}
}

// stopDockerd stops this engine's dockerd by its PID (SIGTERM, then SIGKILL
// after timeout) and then whatever it leaves behind: its containerd and
// shims, and any other process in the engine's network namespace but the
// legacy overlayd. The engine's mount namespace goes with them.
func (e *engine) stopDockerd(timeout time.Duration) error {
	if e.done == nil {
		return nil // never started
	}
	var err error
	// A dockerd that died by itself (or was killed by a test) still
	// leaves its containerd and shims: they are ended below as well.
	if e.running() {
		e.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-e.done:
		case <-time.After(timeout):
			err = fmt.Errorf("dockerd did not stop within %v of SIGTERM; killed", timeout)
			e.cmd.Process.Kill()
			<-e.done
		}
	}
	if e.logFile != nil {
		e.logFile.Close()
		e.logFile = nil
	}
	ovdPid := -1
	if e.ovd != nil && e.ovd.running() {
		ovdPid = e.ovd.cmd.Process.Pid
	}
	leftover := func(p procInfo) bool {
		return p.pid != ovdPid && (p.netns == e.ns.id || strings.Contains(p.cmdline, e.dir+"/exec/") || strings.Contains(p.cmdline, e.dir+"/data/"))
	}
	// containerd 2's shims (Docker 28.5) outlive their dockerd and
	// containerd: say which processes are ended here, by PID.
	var outlived []string
	for _, p := range listProcs() {
		if p.state != 'Z' && leftover(p) {
			outlived = append(outlived, fmt.Sprintf("%s (pid %d)", p.comm, p.pid))
		}
	}
	if len(outlived) > 0 {
		e.t.Logf("engine %s: outlived dockerd, ended by PID: %s", e.name, strings.Join(outlived, ", "))
	}
	left := killProcs(leftover, 10*time.Second)
	// The containers of a dockerd that died (their shims ended above) are
	// in none of those: they go by the engine's cgroup parent.
	killCgroup(e.cgroupParent)
	reapOrphans(false)
	if len(left) > 0 {
		err = errors.Join(err, fmt.Errorf("processes of engine %s still running: %v", e.name, left))
	}
	return err
}

// restartDockerd stops and starts dockerd with the same directories.
func (e *engine) restartDockerd() {
	e.t.Helper()
	if err := e.stopDockerd(60 * time.Second); err != nil {
		e.t.Errorf("engine %s: %v", e.name, err)
	}
	start := time.Now()
	if err := e.startDockerd(); err != nil {
		e.t.Fatalf("engine %s restart: %v", e.name, err)
	}
	e.t.Logf("engine %s: dockerd restarted, ready in %v", e.name, time.Since(start).Round(time.Millisecond))
}

// close runs in the lab's clean-up: it removes what the test may have left
// (containers, networks, plugins) while overlayd still runs, stops dockerd,
// overlayd and every process of the engine, removes its cgroups and its
// namespace's links.
func (e *engine) close() {
	t := e.t
	if t.Failed() {
		t.Logf("engine %s dockerd log (tail):\n%s", e.name, e.logTail(60))
		if e.ovd != nil {
			t.Logf("engine %s overlayd log (tail):\n%s", e.name, e.ovd.logTail(60))
		}
	}
	if e.running() {
		if ids := strings.Fields(e.dockerQuiet("ps", "-aq")); len(ids) > 0 {
			e.dockerQuiet(append([]string{"rm", "-f"}, ids...)...)
		}
		for _, n := range strings.Fields(e.dockerQuiet("network", "ls", "-q", "--filter", "type=custom")) {
			e.dockerQuiet("network", "rm", n)
		}
		for _, p := range strings.Fields(e.dockerQuiet("plugin", "ls", "-q")) {
			e.dockerQuiet("plugin", "rm", "-f", p)
		}
	}
	if err := e.stopDockerd(60 * time.Second); err != nil {
		t.Errorf("engine %s: %v", e.name, err)
	}
	if e.ovd != nil {
		if err := e.ovd.stop(); err != nil {
			t.Errorf("engine %s: %v", e.name, err)
		}
	}
	if e.rec != nil {
		e.rec.close()
	}
	if e.ns != nil {
		left := killProcs(func(p procInfo) bool {
			return p.netns == e.ns.id || strings.Contains(p.cmdline, e.dir+"/")
		}, 10*time.Second)
		if len(left) > 0 {
			t.Errorf("engine %s: processes left: %v", e.name, left)
		}
	}
	killCgroup(e.cgroupParent)
	if err := removeCgroup(e.cgroupParent); err != nil {
		t.Errorf("engine %s: %v", e.name, err)
	}
	if e.ns != nil {
		e.ns.close()
	}
}

func (e *engine) logTail(n int) string {
	b, _ := os.ReadFile(filepath.Join(e.dir, "dockerd.log"))
	return tail(string(b), n)
}

// docker runs Debian's docker CLI against this engine and returns its
// combined output (trimmed); the error carries the output.
func (e *engine) docker(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, dockerCLI, append([]string{"-H", "unix://" + e.sock}, args...)...)
	cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+e.cliConfig)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	s := strings.TrimSpace(out.String())
	if err != nil {
		return s, fmt.Errorf("docker %s: %v: %s", strings.Join(args, " "), err, s)
	}
	return s, nil
}

// must is docker that fails the test on error.
func (e *engine) must(args ...string) string {
	e.t.Helper()
	out, err := e.docker(args...)
	if err != nil {
		e.t.Fatalf("engine %s: %v", e.name, err)
	}
	return out
}

// dockerQuiet is docker for clean-up: errors are ignored.
func (e *engine) dockerQuiet(args ...string) string {
	out, _ := e.docker(args...)
	return out
}

func (e *engine) importImage() {
	e.t.Helper()
	start := time.Now()
	e.must("import", "-c", `CMD ["/bin/sh"]`, "-c", "ENV PATH=/bin", imageTar, image)
	e.t.Logf("engine %s: image imported in %v", e.name, time.Since(start).Round(time.Millisecond))
}

// in runs a command in the engine's network namespace (e.g. iptables).
func (e *engine) in(args ...string) (string, error) {
	cmd := exec.Command("nsenter", append([]string{"--net=/proc/self/fd/3", "--"}, args...)...)
	cmd.ExtraFiles = []*os.File{e.ns.file}
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}
