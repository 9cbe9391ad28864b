package docker

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// registryAddr is where the lab's registry listens: the switch's underlay
// address, which every engine reaches over its eth0.
var registryAddr = netip.AddrPortFrom(netip.MustParsePrefix(switchAddr).Addr(), 5000).String()

const registryBinary = "/usr/bin/docker-registry"

// startRegistry runs Debian's docker-registry in the lab's switch namespace
// on registryAddr, with its own configuration and storage in the lab
// directory, and stops it (by its PID) when the test ends. Set before the
// engines start, so that their dockerds trust it (l.registry).
func (l *lab) startRegistry() {
	t := l.t
	t.Helper()
	if err := aptInstall(func() []string {
		if _, err := os.Stat(registryBinary); err != nil {
			return []string{"docker-registry"}
		}
		return nil
	}); err != nil {
		t.Fatalf("docker-registry: %v", err)
	}
	dir := filepath.Join(l.dir, "registry")
	if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: %s
http:
  addr: %s
`, filepath.Join(dir, "data"), registryAddr)), 0o644); err != nil {
		t.Fatal(err)
	}
	lf, err := os.Create(filepath.Join(dir, "registry.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("nsenter", "--net=/proc/self/fd/3", "--", registryBinary, "serve", cfg)
	cmd.ExtraFiles = []*os.File{l.sw.file}
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		lf.Close()
		t.Fatalf("start %s: %v", registryBinary, err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Errorf("docker-registry (pid %d) did not stop within 10s of SIGTERM; killed", cmd.Process.Pid)
			cmd.Process.Kill()
			<-done
		}
		lf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(lf.Name())
			t.Logf("registry log (tail):\n%s", tail(string(b), 40))
		}
	})
	l.registry = registryAddr
	// Ready when it answers the registry API's version check (from the
	// switch namespace, where it listens).
	eventually(t, 20*time.Second, "docker-registry answering on "+registryAddr, func() string {
		select {
		case err := <-done:
			done <- err
			b, _ := os.ReadFile(lf.Name())
			return fmt.Sprintf("exited (%v):\n%s", err, tail(string(b), 20))
		default:
		}
		err := netnsutil.DoIn(l.sw.h, func() error {
			c, err := net.DialTimeout("tcp", registryAddr, time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(2 * time.Second))
			fmt.Fprintf(c, "GET /v2/ HTTP/1.0\r\nHost: %s\r\n\r\n", registryAddr)
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil {
				return err
			}
			if !strings.Contains(line, " 200 ") {
				return fmt.Errorf("GET /v2/: %s", strings.TrimSpace(line))
			}
			return nil
		})
		if err != nil {
			return err.Error()
		}
		return ""
	})
	t.Logf("docker-registry pid %d on %s (switch namespace)", cmd.Process.Pid, registryAddr)
}

// pluginVersion builds overlayd with version stamp and assembles a managed
// plugin directory of it (as `make plugin` does).
func (l *lab) pluginVersion(t *testing.T, stamp string) string {
	t.Helper()
	bin := filepath.Join(l.dir, "overlayd-"+stamp)
	if err := buildOverlayd(bin, stamp); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(l.dir, "plugin-"+stamp)
	script := filepath.Join(moduleRoot(), "plugin", "mkplugin.sh")
	if b, err := exec.Command("sh", script, dir, bin).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", script, err, b)
	}
	return dir
}

// TestPluginFromRegistry is the way Docker users install plugins: the
// managed plugin is created on one engine and pushed to a registry
// (Debian's docker-registry, on the lab's underlay), installed from it on
// another engine with `docker plugin install` (its privileges prompt, then
// --grant-all-permissions), used across the two hosts, and upgraded with
// `docker plugin upgrade` to a newer build while containers on both hosts
// ping each other without pause.
func TestPluginFromRegistry(t *testing.T) {
	l := newLab(t)
	l.startRegistry()
	h1, h2 := l.addEngine("h1", 1), l.addEngine("h2", 2)
	const stamp1, stamp2 = "registry-test-1", "registry-test-2"
	ref1, ref2 := registryAddr+"/overlayd:1", registryAddr+"/overlayd:2"
	dir1 := l.pluginVersion(t, stamp1)

	start := time.Now()
	h1.must("plugin", "create", ref1, dir1)
	h1.must("plugin", "push", ref1)
	timing(t, "docker plugin create + push (version 1)", time.Since(start))

	key := clusterKey()
	// The sandboxes in the state mount (rshared), not in the propagated
	// mount: dockerd unmounts that on docker plugin disable, which an
	// upgrade needs, and the sandboxes and the containers' overlay
	// interfaces would go with it.
	const keyFile, netnsDir = "/var/lib/overlayd/cluster.key", "/var/lib/overlayd/netns"
	// Each host's state directory, with the cluster key, on a shared mount
	// as systemd makes every mount (the engines' mount namespaces are
	// slaves of the host's).
	for _, e := range []*engine{h1, h2} {
		state := filepath.Join(e.dir, "plugin-state")
		if err := os.MkdirAll(state, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(state, filepath.Base(keyFile)), key, 0o600); err != nil {
			t.Fatal(err)
		}
		if out, err := e.inMount("sh", "-c", `mount --bind "$0" "$0" && mount --make-shared "$0"`, state); err != nil {
			t.Fatalf("engine %s: make %s a shared mount: %v: %s", e.name, state, err, out)
		}
	}
	settings := func(e *engine) []string {
		s := []string{"state.source=" + filepath.Join(e.dir, "plugin-state"), "OVERLAYD_NETNS_DIR=" + netnsDir,
			"OVERLAYD_ADVERTISE_ADDR=" + e.addr.String(), "OVERLAYD_NODE_NAME=" + e.name,
			"OVERLAYD_SECRET_FILE=" + keyFile, "OVERLAYD_LOG_LEVEL=debug",
			// Each engine creates its networks itself here.
			"OVERLAYD_NETSYNC=off"}
		if e != h1 {
			s = append(s, "OVERLAYD_JOIN="+h1.addr.String())
		}
		return s
	}
	h1.must(append([]string{"plugin", "set", ref1}, settings(h1)...)...)
	h1.must("plugin", "enable", ref1)

	// Without --grant-all-permissions the CLI lists the privileges and asks;
	// no answer (no terminal) is a refusal, and nothing is installed.
	out, err := h2.docker("plugin", "install", ref1)
	t.Logf("docker plugin install without a grant: %v", err)
	for _, want := range []string{"network: [host]", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "Do you grant the above permissions?"} {
		if !strings.Contains(out, want) {
			t.Errorf("docker plugin install's privileges prompt lacks %q:\n%s", want, out)
		}
	}
	if err == nil {
		t.Errorf("docker plugin install without a grant and without an answer installed the plugin:\n%s", out)
	}
	if ls := h2.must("plugin", "ls", "-q"); ls != "" {
		t.Fatalf("plugins after a refused install: %s", ls)
	}

	// The README's way: an alias, the grant, the settings; install enables.
	const alias = "overlayd:latest"
	start = time.Now()
	h2.must(append([]string{"plugin", "install", "--grant-all-permissions", "--alias", "overlayd", ref1}, settings(h2)...)...)
	timing(t, "docker plugin install from the registry (pull + enable)", time.Since(start))
	if got := h2.must("plugin", "inspect", "-f", "{{.Enabled}} {{.PluginReference}}", alias); got != "true "+ref1 {
		t.Fatalf("installed plugin: enabled and reference %q, want %q", got, "true "+ref1)
	}

	h1.createNetwork(ref1, "n1", "-o", "vni=4601", "--subnet", "192.0.2.0/26")
	h2.createNetwork(alias, "n1", "-o", "vni=4601", "--subnet", "192.0.2.0/26")
	h1.run("c1", "n1", "192.0.2.2")
	h2.run("c2", "n1", "192.0.2.3")
	rtt := h1.waitPing("c1", "192.0.2.3")
	timing(t, "cross-host ping RTT (plugin installed from the registry)", rtt)
	h2.waitPing("c2", "192.0.2.2")

	// Version 2: a newer build, pushed as tag 2.
	dir2 := l.pluginVersion(t, stamp2)
	h1.must("plugin", "create", ref2, dir2)
	h1.must("plugin", "push", ref2)
	h1.must("plugin", "rm", ref2)

	id := h2.must("plugin", "inspect", "-f", "{{.Id}}", alias)
	sandboxDir := filepath.Join(h2.dir, "plugin-state", "netns")
	before := sandboxesIn(h2.mountsUnder(sandboxDir), sandboxDir)
	if len(before) != 1 {
		t.Fatalf("sandbox mounts under the state directory in dockerd's mount namespace: %v, want one", before)
	}

	// Both directions ping every 100 ms across the upgrade of h2's plugin.
	p1 := startPinger(t, h1, "c1", "192.0.2.3")
	p2 := startPinger(t, h2, "c2", "192.0.2.2")
	p1.waitReplies(5)
	p2.waitReplies(5)

	// dockerd upgrades a disabled plugin only, and a plugin with networks
	// is in use: disable needs -f.
	if out, err := h2.docker("plugin", "disable", alias); err == nil {
		t.Errorf("docker plugin disable of a plugin with networks succeeded: %s", out)
	} else {
		t.Logf("docker plugin disable without -f: %v", err)
	}
	upStart := time.Now()
	h2.must("plugin", "disable", "-f", alias)
	disabled := time.Since(upStart)
	during := sandboxesIn(h2.mountsUnder(sandboxDir), sandboxDir)
	c2Ifaces := h2.ifaces("c2")
	// The CLI asks before changing a plugin's repository or tag:
	// --skip-remote-check answers it.
	h2.must("plugin", "upgrade", "--grant-all-permissions", "--skip-remote-check", alias, ref2)
	upgraded := time.Since(upStart)
	// Set the settings again before the enable: Docker 20.10 showed them
	// kept after the upgrade but started the new version with the
	// config's default source of the 'state' mount (which does not exist).
	t.Logf("settings after docker plugin upgrade: %s", h2.must("plugin", "inspect", "-f", "{{json .Settings}}", alias))
	h2.must(append([]string{"plugin", "set", alias}, settings(h2)...)...)
	h2.must("plugin", "enable", alias)
	enabled := time.Since(upStart)
	timing(t, "docker plugin disable -f", disabled)
	timing(t, "docker plugin disable -f + upgrade", upgraded)
	timing(t, "docker plugin disable -f + upgrade + set + enable (plugin process absent)", enabled)

	if got := h2.must("plugin", "inspect", "-f", "{{.Enabled}} {{.PluginReference}} {{.Id}}", alias); got != "true "+ref2+" "+id {
		t.Errorf("upgraded plugin: %q, want enabled, reference %s and the same id %s", got, ref2, id)
	}
	eventually(t, 10*time.Second, "h2's plugin reports version "+stamp2, func() string {
		if h2.countInLog("overlayd serving", stamp2) == 0 {
			return "no 'overlayd serving' line with " + stamp2 + " in dockerd's log"
		}
		return ""
	})
	// A new container on the upgraded plugin reaches the other host.
	h2.run("c3", "n1", "192.0.2.4")
	h2.waitPing("c3", "192.0.2.2")

	t.Logf("sandbox mounts of h2's plugin in dockerd's mount namespace: before the disable %d, after it %d; c2's interfaces after it: %v",
		len(before), len(during), c2Ifaces)
	if len(during) != len(before) || !contains(c2Ifaces, "eth0") {
		t.Errorf("docker plugin disable took the sandbox (mounts %v) or c2's overlay interface (%v)", during, c2Ifaces)
	}
	// Enough echoes after the enable to see a delayed loss (the other
	// host's grace for a silent member is 10 s).
	p1.waitReplies(p1.replies() + 120)
	p2.waitReplies(p2.replies() + 120)
	for _, p := range []*pinger{p1, p2} {
		sent, got, lost := p.stop()
		t.Logf("%s -> %s across the upgrade: %d sent, %d answered, lost seq %v", p.c, p.dst, sent, got, lost)
		if sent == 0 || got != sent {
			t.Errorf("%s -> %s: lost %d of %d echoes across docker plugin upgrade (seq %v)", p.c, p.dst, sent-got, sent, lost)
		}
	}
}

// pinger is a busybox ping (every 100 ms, no count) running in a container
// through docker exec, whose replies are counted as they arrive.
type pinger struct {
	t      *testing.T
	e      *engine
	c, dst string
	cmd    *exec.Cmd
	done   chan struct{}

	mu      sync.Mutex
	seqs    []int
	summary string
}

func startPinger(t *testing.T, e *engine, c, dst string) *pinger {
	t.Helper()
	p := &pinger{t: t, e: e, c: c, dst: dst, done: make(chan struct{})}
	p.cmd = exec.Command(dockerCLI, "-H", "unix://"+e.sock, "exec", c, "ping", "-i", "0.1", "-W", "1", dst)
	p.cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+e.cliConfig)
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stderr = p.cmd.Stdout
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("ping %s from %s: %v", dst, c, err)
	}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			if i := strings.Index(line, "seq="); i >= 0 {
				n, _ := strconv.Atoi(strings.Fields(line[i+4:])[0])
				p.seqs = append(p.seqs, n)
			} else {
				p.summary += line + "\n"
			}
			p.mu.Unlock()
		}
		p.cmd.Wait()
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
	})
	return p
}

func (p *pinger) replies() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.seqs)
}

// waitReplies waits until n echoes have been answered (100 ms each, with
// ample slack).
func (p *pinger) waitReplies(n int) {
	p.t.Helper()
	eventually(p.t, time.Duration(n)*time.Second/10+30*time.Second, fmt.Sprintf("%d echoes %s -> %s answered", n, p.c, p.dst), func() string {
		if got := p.replies(); got < n {
			return fmt.Sprintf("%d answered", got)
		}
		return ""
	})
}

// stop interrupts the ping in the container (SIGINT: it prints its
// summary) and returns echoes sent and answered and the missing sequence
// numbers.
func (p *pinger) stop() (sent, got int, lost []int) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, dockerCLI, "-H", "unix://"+p.e.sock, "exec", p.c, "killall", "-INT", "ping").CombinedOutput(); err != nil {
		p.t.Fatalf("stop ping in %s: %v: %s", p.c, err, out)
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		p.t.Fatalf("ping in %s did not end after SIGINT", p.c)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	m := lossRE.FindStringSubmatch(p.summary)
	if m == nil {
		p.t.Fatalf("ping %s from %s: no summary:\n%s", p.dst, p.c, p.summary)
	}
	sent, _ = strconv.Atoi(m[1])
	got, _ = strconv.Atoi(m[2])
	answered := map[int]bool{}
	for _, s := range p.seqs {
		answered[s] = true
	}
	for s := 0; s < sent; s++ {
		if !answered[s] {
			lost = append(lost, s)
		}
	}
	// The echo sent last may still be on its way when SIGINT ends ping
	// (its reply comes within 1 ms, ping's interval is 100 ms): not a loss.
	if n := len(lost); n > 0 && lost[n-1] == sent-1 && sent > got {
		lost, sent = lost[:n-1], sent-1
	}
	return sent, got, lost
}
