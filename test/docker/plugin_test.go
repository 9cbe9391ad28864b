package docker

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const pluginRef = "overlayd:latest"

// pluginConfig is the part of a managed plugin's config.json we check.
type pluginConfig struct {
	Entrypoint []string `json:"entrypoint"`
	Interface  struct {
		Types  []string `json:"types"`
		Socket string   `json:"socket"`
	} `json:"interface"`
	Network struct {
		Type string `json:"type"`
	} `json:"network"`
	Linux struct {
		Capabilities []string `json:"capabilities"`
	} `json:"linux"`
	PropagatedMount string `json:"propagatedMount"`
	Mounts          []struct {
		Name        string   `json:"name"`
		Source      string   `json:"source"`
		Destination string   `json:"destination"`
		Settable    []string `json:"settable"`
		Options     []string `json:"options"`
	} `json:"mounts"`
	Env []struct {
		Name     string   `json:"name"`
		Value    string   `json:"value"`
		Settable []string `json:"settable"`
	} `json:"env"`
}

// buildPluginDir assembles the managed plugin as `make plugin` does (same
// script, same config template), from this run's overlayd binary.
func buildPluginDir(t *testing.T, out string) pluginConfig {
	t.Helper()
	script := filepath.Join(moduleRoot(), "plugin", "mkplugin.sh")
	if b, err := exec.Command("sh", script, out, overlayd).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", script, err, b)
	}
	b, err := os.ReadFile(filepath.Join(out, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg pluginConfig
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatalf("plugin config.json: %v", err)
	}
	if !isStaticELF(filepath.Join(out, "rootfs", "bin", "overlayd")) {
		t.Errorf("plugin rootfs: /bin/overlayd is not a static executable")
	}
	return cfg
}

// TestPluginConfig checks the managed plugin's config against what overlayd
// and dockerd need: every OVERLAYD_* setting that `overlayd --help` lists is
// in env, and the fixed paths agree with the socket, mounts and propagated
// mount.
func TestPluginConfig(t *testing.T) {
	prepare(t)
	cfg := buildPluginDir(t, filepath.Join(runRoot, "plugin-config"))
	if len(cfg.Entrypoint) == 0 || cfg.Entrypoint[0] != "/bin/overlayd" {
		t.Errorf("entrypoint %v, want /bin/overlayd", cfg.Entrypoint)
	}
	// Both APIs on the one socket: dockerd looks a managed plugin up
	// for --ipam-driver only if it declares the IPAM interface.
	if !slices.Equal(cfg.Interface.Types, []string{"docker.networkdriver/1.0", "docker.ipamdriver/1.0"}) {
		t.Errorf("interface types %v, want docker.networkdriver/1.0 and docker.ipamdriver/1.0", cfg.Interface.Types)
	}
	if cfg.Network.Type != "host" {
		t.Errorf("network type %q, want host (sandboxes' VXLAN sockets and veth host ends live in the host namespace)", cfg.Network.Type)
	}
	for _, c := range []string{"CAP_NET_ADMIN", "CAP_SYS_ADMIN"} {
		if !contains(cfg.Linux.Capabilities, c) {
			t.Errorf("capabilities %v lack %s", cfg.Linux.Capabilities, c)
		}
	}
	help, err := exec.Command(overlayd, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("overlayd --help: %v\n%s", err, help)
	}
	want := regexp.MustCompile(`\$(OVERLAYD_[A-Z0-9_]+)`).FindAllStringSubmatch(string(help), -1)
	env := map[string]string{}
	settable := map[string]bool{}
	for _, e := range cfg.Env {
		env[e.Name] = e.Value
		settable[e.Name] = contains(e.Settable, "value")
	}
	var missing []string
	for _, m := range want {
		if _, ok := env[m[1]]; !ok {
			missing = append(missing, m[1])
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("plugin config.json env lacks settings that overlayd --help lists: %v", missing)
	}
	if got, want := env["OVERLAYD_SOCKET"], "/run/docker/plugins/"+cfg.Interface.Socket; got != want {
		t.Errorf("OVERLAYD_SOCKET %q, want %q (dockerd mounts the socket directory at /run/docker/plugins)", got, want)
	}
	if nd := env["OVERLAYD_NETNS_DIR"]; cfg.PropagatedMount == "" || !strings.HasPrefix(nd, cfg.PropagatedMount+"/") {
		t.Errorf("OVERLAYD_NETNS_DIR %q is not inside the propagated mount %q: sandboxes would die with the plugin process", nd, cfg.PropagatedMount)
	}
	stateMounted := false
	for _, m := range cfg.Mounts {
		if m.Destination == env["OVERLAYD_STATE_DIR"] {
			stateMounted = true
			// OVERLAYD_NETNS_DIR may be set below the state directory:
			// sandboxes then reach the host through this mount and
			// outlive docker plugin disable and upgrade (dockerd unmounts
			// the propagated mount then).
			if !contains(m.Options, "rshared") {
				t.Errorf("the state mount's options %v lack rshared: sandboxes below it would die with the plugin process", m.Options)
			}
		}
	}
	if !stateMounted {
		t.Errorf("OVERLAYD_STATE_DIR %q is not a mount destination: state would be lost with the plugin", env["OVERLAYD_STATE_DIR"])
	}
	// The control socket sits next to the plugin socket: dockerd's socket
	// directory for the plugin is the host's /run/docker/plugins/<id>/, a
	// path short enough for a socket address (the propagated mount's host
	// path, /var/lib/docker/plugins/<id>/propagated-mount/, is not).
	if cs, ok := env["OVERLAYD_CONTROL_SOCKET"]; ok {
		if filepath.Dir(cs) != "/run/docker/plugins" {
			t.Errorf("OVERLAYD_CONTROL_SOCKET %q is not in the plugin's socket directory /run/docker/plugins: the host could not reach it", cs)
		}
		if host := "/run/docker/plugins/" + strings.Repeat("0", 64) + "/" + filepath.Base(cs); len(host) > 107 {
			t.Errorf("OVERLAYD_CONTROL_SOCKET: the host path %s is too long for a socket address", host)
		}
	}
	for _, fixed := range []string{"OVERLAYD_SOCKET", "OVERLAYD_STATE_DIR", "OVERLAYD_CONTROL_SOCKET"} {
		if settable[fixed] {
			t.Errorf("%s is settable, but it must agree with the config's socket, mounts and propagated mount", fixed)
		}
	}
	for name := range env {
		if !strings.HasPrefix(name, "OVERLAYD_") {
			t.Errorf("env %s: not an overlayd setting", name)
		}
	}
}

// TestManagedPlugin installs overlayd as a managed plugin (docker plugin
// create + enable) in an engine, runs two containers on a network of it that
// ping each other, and removes everything.
func TestManagedPlugin(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	dir, state := l.pluginFiles(t)

	start := time.Now()
	e.must("plugin", "create", pluginRef, dir)
	timing(t, "docker plugin create", time.Since(start))
	e.must("plugin", "set", pluginRef, "state.source="+state, "OVERLAYD_LOG_LEVEL=debug",
		"OVERLAYD_ADVERTISE_ADDR="+e.addr.String())
	start = time.Now()
	e.must("plugin", "enable", pluginRef)
	timing(t, "docker plugin enable (includes dockerd's fixed 500ms wait before its first dial)", time.Since(start))
	id := e.must("plugin", "inspect", "-f", "{{.Id}}", pluginRef)
	t.Logf("plugin id %s", id)

	d := e.createNetwork(pluginRef, "m1", "-o", "vni=4401", "--subnet", "192.0.2.0/26")
	timing(t, "docker network create (managed plugin)", d)
	start = time.Now()
	if _, err := e.docker("run", "-d", "--name", "m1c1", "--network", "m1", "--ip", "192.0.2.2", "--stop-timeout", "1", image, sleeper[0], sleeper[1], sleeper[2]); err != nil {
		t.Fatal(err)
	}
	timing(t, "first container start on a network (managed plugin)", time.Since(start))
	e.run("m1c2", "m1", "192.0.2.3")
	rtt := e.mustPing("m1c1", "192.0.2.3")
	timing(t, "ping RTT (managed plugin, same engine)", rtt)
	e.mustPing("m1c2", "m1c1")

	// The sandbox is a mount in the propagated mount: dockerd's mount
	// namespace (the engine's) has it, so it outlives the plugin process.
	prop := filepath.Join(e.dir, "data", "plugins", id, "propagated-mount")
	sandboxDir := filepath.Join(prop, "netns")
	// overlayd makes its netns directory a shared mount of itself, so that
	// directory is a mount too and a sandbox may be listed once per peer.
	if m := sandboxesIn(e.mountsUnder(sandboxDir), sandboxDir); len(m) != 1 {
		t.Errorf("sandbox mounts under the propagated mount in the engine's mount namespace: %v, want one", m)
	}
	if links := e.overlaydLinks(); len(links) > 0 {
		t.Errorf("overlayd links left in the engine namespace while joined: %v", links)
	}
	// A plugin restart under running containers: the plugin process dies
	// (SIGKILL) and dockerd restarts it. The sandboxes live in the
	// propagated mount, which dockerd keeps across such a restart, so the
	// kernel state outlives the process and pings go on; the new process
	// adopts it from its state (the 'state' mount). (A deliberate
	// `docker plugin disable -f` is different on Docker 20.10 and 26.1:
	// dockerd then unmounts the propagated mount recursively, and the
	// sandboxes go, unless OVERLAYD_NETNS_DIR puts them in the state mount:
	// TestPluginFromRegistry.)
	pings := make(chan string, 1)
	go func() {
		out, _ := e.docker("exec", "m1c1", "ping", "-i", "0.1", "-c", "60", "-W", "1", "192.0.2.3")
		pings <- out
	}()
	time.Sleep(2 * time.Second)
	old := e.pluginPIDs()
	if len(old) != 1 {
		t.Fatalf("plugin processes %v, want one", old)
	}
	start = time.Now()
	syscall.Kill(old[0], syscall.SIGKILL)
	for {
		if now := e.pluginPIDs(); len(now) == 1 && now[0] != old[0] && e.pluginServing(id) {
			break
		}
		if time.Since(start) > 20*time.Second {
			t.Fatalf("dockerd did not restart the killed plugin within 20s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	timing(t, "managed plugin restart by dockerd after SIGKILL (to socket answering)", time.Since(start))
	out := <-pings
	m := lossRE.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("ping during the plugin restart:\n%s", out)
	}
	sent, _ := strconv.Atoi(m[1])
	got, _ := strconv.Atoi(m[2])
	t.Logf("pings lost during a managed plugin restart: %d of %d (every 100ms)", sent-got, sent)
	if got < sent-2 {
		t.Errorf("lost %d of %d pings across a plugin restart", sent-got, sent)
	}
	e.run("m1c3", "m1", "192.0.2.4")
	e.mustPing("m1c3", "192.0.2.2")

	// The managed plugin is also an IPAM driver (config.json declares
	// docker.ipamdriver/1.0): --ipam-driver with its reference hands out
	// the addresses, the gateway being the subnet's first.
	e.createNetwork(pluginRef, "m2", "--ipam-driver", pluginRef, "-o", "vni=4402", "--subnet", "192.0.2.64/26")
	if d := e.must("network", "inspect", "-f", "{{.IPAM.Driver}}", "m2"); d != pluginRef {
		t.Errorf("IPAM driver of a network with --ipam-driver %s: %q", pluginRef, d)
	}
	e.run("m2c1", "m2", "")
	e.run("m2c2", "m2", "")
	a1 := e.must("inspect", "-f", "{{.NetworkSettings.Networks.m2.IPAddress}}", "m2c1")
	a2 := e.must("inspect", "-f", "{{.NetworkSettings.Networks.m2.IPAddress}}", "m2c2")
	if a1 == a2 || !strings.HasPrefix(a1, "192.0.2.") || !strings.HasPrefix(a2, "192.0.2.") {
		t.Errorf("containers of the managed plugin's IPAM got %q and %q: want two distinct addresses of 192.0.2.64/26", a1, a2)
	}
	e.mustPing("m2c1", a2)
	e.mustPing("m2c2", "192.0.2.65") // the gateway, on the sandbox's bridge
	e.must("rm", "-f", "m2c1", "m2c2")
	e.must("network", "rm", "m2")

	// `overlayd status` reaches the plugin from the host (dockerd's mount
	// namespace) through its control socket.
	if out, err := e.inMount(overlayd, "status", "--json", "--control-socket", "/run/docker/plugins/"+id+"/control.sock"); err != nil || !hasNumber(out, 4401) {
		t.Errorf("overlayd status of the managed plugin: %v: %s", err, out)
	}

	// The plugin's stdout reaches dockerd's log.
	if lg := e.logTail(100000); !strings.Contains(lg, "overlayd serving") {
		t.Errorf("dockerd's log lacks the plugin's start-up line")
	}

	e.must("rm", "-f", "m1c1", "m1c2")
	e.dockerQuiet("rm", "-f", "m1c3")
	e.must("network", "rm", "m1")
	deadline := time.Now().Add(10 * time.Second)
	for {
		m, links := sandboxesIn(e.mountsUnder(sandboxDir), sandboxDir), e.overlaydLinks()
		files, _ := os.ReadDir(sandboxDir)
		if len(m)+len(links)+len(files) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind: sandbox mounts %v, files %d, links %v", m, len(files), links)
		}
		time.Sleep(100 * time.Millisecond)
	}

	start = time.Now()
	e.must("plugin", "disable", pluginRef)
	timing(t, "docker plugin disable", time.Since(start))
	e.must("plugin", "rm", pluginRef)
	if out := e.must("plugin", "ls", "-q"); out != "" {
		t.Errorf("plugins left: %s", out)
	}
	if _, err := os.Stat(filepath.Join(e.dir, "data", "plugins", id)); !os.IsNotExist(err) {
		t.Errorf("plugin directory left after plugin rm (%v)", err)
	}
	// No plugin process is left: only dockerd and its containerd remain in
	// the engine's namespace.
	for _, p := range listProcs() {
		if p.netns == e.ns.id && p.comm == "overlayd" {
			t.Errorf("plugin process left: %d %s", p.pid, p.cmdline)
		}
	}
}

// pluginFiles assembles the managed plugin's directory in the lab and
// makes a state directory for its 'state' mount.
func (l *lab) pluginFiles(t *testing.T) (dir, state string) {
	t.Helper()
	dir = filepath.Join(l.dir, "plugin")
	buildPluginDir(t, dir)
	state = filepath.Join(l.dir, "plugin-state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir, state
}

// mountsUnder lists the mounts under dir in the engine's mount namespace
// (dockerd's).
func (e *engine) mountsUnder(dir string) []string {
	if !e.running() {
		return nil
	}
	return mountsUnderIn(fmt.Sprintf("/proc/%d/mountinfo", e.cmd.Process.Pid), dir)
}

// pluginPIDs lists the managed plugin's processes (overlayd in the engine's
// network namespace).
func (e *engine) pluginPIDs() []int {
	var pids []int
	for _, p := range listProcs() {
		if p.netns == e.ns.id && p.comm == "overlayd" && p.state != 'Z' {
			pids = append(pids, p.pid)
		}
	}
	return pids
}

// pluginServing reports whether the managed plugin id answers on its socket
// (in the engine's /run/docker/plugins/<id>/). The host path is longer than a
// socket address may be, so it is reached through a descriptor of its
// directory.
func (e *engine) pluginServing(id string) bool {
	d, err := os.Open(filepath.Join(e.pluginDir, id))
	if err != nil {
		return false
	}
	defer d.Close()
	c, err := net.Dial("unix", fmt.Sprintf("/proc/self/fd/%d/overlayd.sock", d.Fd()))
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// sandboxesIn returns the distinct mount points strictly below dir.
func sandboxesIn(mounts []string, dir string) []string {
	seen := map[string]bool{}
	var out []string
	for _, m := range mounts {
		if filepath.Clean(m) == filepath.Clean(dir) || seen[m] {
			continue
		}
		seen[m] = true
		out = append(out, m)
	}
	return out
}
