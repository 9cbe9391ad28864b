// Package multihost runs the overlayd binary on three "hosts" — network
// namespaces joined by an underlay bridge — gossiping over their underlay
// addresses, drives each through the plugin API as dockerd would, and checks
// that containers on every host reach every other, that an IP moving between
// hosts is reachable again quickly, and that a killed host's peers vanish
// from the others' sandboxes.
package multihost

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/logbuf"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

const (
	vni     = 300
	netID   = "multihost-net"
	subnet  = "198.51.100.0/24"
	gateway = "198.51.100.1/24"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

func binary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "overlayd-multihost-bin")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "overlayd")
		out, err := exec.Command("go", "build", "-o", binPath, "../../cmd/overlayd").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// host is one overlayd process in its own namespace.
type host struct {
	name     string
	ns       *nstest.NS
	vtep     netip.Addr
	dir      string
	netnsDir string
	cmd      *exec.Cmd
	join0    []string // seeds it was first started with
	// swarm: started as a managed plugin in a swarm is, with scope global
	// and no address: it learns its VTEP from DiscoverNew (Self).
	swarm  bool
	logs   *logbuf.Buffer
	plugin *http.Client
	// metricsAddr, if set, is given as --metrics-addr (an address in the
	// host's namespace: loopback).
	metricsAddr string
}

func (h *host) socket() string  { return filepath.Join(h.dir, "overlayd.sock") }
func (h *host) control() string { return filepath.Join(h.dir, "control.sock") }

// nsPath is a path of h's network namespace for nsenter --net.
func (h *host) nsPath() string { return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), int(h.ns.Handle)) }

func startHost(t *testing.T, h *host, keyFile string, join []string) {
	t.Helper()
	args := []string{"--net=" + h.nsPath(), binary(t),
		"--socket", h.socket(), "--state-dir", filepath.Join(h.dir, "state"), "--netns-dir", h.netnsDir,
		"--secret-file", keyFile, "--control-socket", h.control(), "--netsync", "off",
		"--node-name", h.name, "--log-level", "debug"}
	if h.swarm {
		args = append(args, "--scope", "global")
	} else {
		args = append(args, "--advertise-addr", h.vtep.String())
	}
	if len(join) > 0 {
		args = append(args, "--join", strings.Join(join, ","))
	}
	if h.metricsAddr != "" {
		args = append(args, "--metrics-addr", h.metricsAddr)
	}
	h.logs = &logbuf.Buffer{}
	h.cmd = exec.Command("nsenter", args...)
	h.cmd.Stdout, h.cmd.Stderr = h.logs, h.logs
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cmd := h.cmd
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Signal(syscall.SIGTERM)
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		}
		if t.Failed() {
			t.Logf("--- logs of %s ---\n%s", h.name, tail(h.logs.String(), 60))
		}
	})
	sock := h.socket()
	h.plugin = &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	if err := nstest.Eventually(10*time.Second, 20*time.Millisecond, func() error {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
		}
		return err
	}); err != nil {
		t.Fatalf("%s never served its plugin socket: %v\n%s", h.name, err, h.logs.String())
	}
}

func tail(s string, lines int) string {
	l := strings.Split(s, "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

func (h *host) call(t *testing.T, method string, body any) map[string]any {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := h.plugin.Post("http://plugin/NetworkDriver."+method, "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatalf("%s %s: %v", h.name, method, err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	var m map[string]any
	json.Unmarshal(out, &m)
	if resp.StatusCode != 200 {
		t.Fatalf("%s %s: %s %s", h.name, method, resp.Status, out)
	}
	return m
}

// status runs `overlayd status --json` against the host's control socket.
func (h *host) status(t *testing.T) map[string]any {
	t.Helper()
	out, err := exec.Command(binary(t), "status", "--json", "--control-socket", h.control()).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: overlayd status --json: %v\n%s", h.name, err, out)
	}
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("%s: status output is not JSON: %v\n%s", h.name, err, out)
	}
	return m
}

// join plays dockerd: CreateEndpoint + Join, then moves the veth into a new
// container namespace.
func (h *host) join(t *testing.T, eid string, addr netip.Prefix) *nstest.NS {
	t.Helper()
	h.call(t, "CreateEndpoint", map[string]any{"NetworkID": netID, "EndpointID": eid, "Interface": map[string]string{"Address": addr.String()}})
	resp := h.call(t, "Join", map[string]any{"NetworkID": netID, "EndpointID": eid, "SandboxKey": "/none"})
	src := resp["InterfaceName"].(map[string]any)["SrcName"].(string)
	return nstest.Container(t, h.name+"-"+eid, h.ns, src, addr, nil)
}

func (h *host) leave(t *testing.T, eid string) {
	t.Helper()
	h.call(t, "Leave", map[string]any{"NetworkID": netID, "EndpointID": eid})
	h.call(t, "DeleteEndpoint", map[string]any{"NetworkID": netID, "EndpointID": eid})
}

// neighbours returns the permanent neighbours (ip → mac) and FDB entries
// (mac → dst) of the network's sandbox on h, from the kernel.
func (h *host) neighbours(t *testing.T) (map[string]string, map[string]string) {
	t.Helper()
	nl, vx := h.vxlan(t)
	defer nl.Close()
	neigh, fdb := map[string]string{}, map[string]string{}
	ns4, _ := nl.NeighList(vx.Attrs().Index, unix.AF_INET)
	for _, n := range ns4 {
		if n.State&netlink.NUD_PERMANENT != 0 {
			neigh[n.IP.String()] = n.HardwareAddr.String()
		}
	}
	br, _ := nl.NeighList(vx.Attrs().Index, unix.AF_BRIDGE)
	for _, f := range br {
		if f.Flags&netlink.NTF_SELF != 0 && f.IP != nil {
			fdb[f.HardwareAddr.String()] = f.IP.String()
		}
	}
	return neigh, fdb
}

// startCluster starts n hosts sharing one cluster key, each joining the
// first, and creates the test network on every one.
func startCluster(t *testing.T, n int) []*host {
	t.Helper()
	return startClusterWith(t, n, nil)
}

// startClusterWith is startCluster with prep called on each host before
// it starts.
func startClusterWith(t *testing.T, n int, prep func(*host)) []*host {
	t.Helper()
	hosts, _ := startHosts(t, n, prep)
	for _, h := range hosts {
		h.call(t, "CreateNetwork", map[string]any{"NetworkID": netID,
			"Options":  map[string]any{"com.docker.network.generic": map[string]string{"vni": fmt.Sprint(vni)}},
			"IPv4Data": []map[string]string{{"Pool": subnet, "Gateway": gateway}}})
	}
	return hosts
}

// startHosts starts n hosts sharing one cluster key (returned: the key
// file), each joining the first, with no network.
func startHosts(t *testing.T, n int, prep func(*host)) ([]*host, string) {
	t.Helper()
	nsHosts, vteps := nstest.Hosts(t, n, false)
	keyFile := filepath.Join(t.TempDir(), "cluster.key")
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i * 7)
	}
	if err := os.WriteFile(keyFile, key, 0o600); err != nil {
		t.Fatal(err)
	}
	var hosts []*host
	for i := range nsHosts {
		h := &host{name: fmt.Sprintf("host%d", i), ns: nsHosts[i], vtep: vteps[i], dir: t.TempDir(), netnsDir: nstest.NetnsDir(t)}
		if prep != nil {
			prep(h)
		}
		var join []string
		if i > 0 {
			join = []string{vteps[0].String()}
		}
		h.join0 = join
		startHost(t, h, keyFile, join)
		hosts = append(hosts, h)
	}
	return hosts, keyFile
}

// vxlan returns a netlink handle in the network's sandbox on h (the
// caller closes it) and the sandbox's VXLAN link.
func (h *host) vxlan(t *testing.T) (*netlink.Handle, netlink.Link) {
	t.Helper()
	ns, err := netnsutil.Open(filepath.Join(h.netnsDir, netID))
	if err != nil {
		t.Fatalf("%s: %v", h.name, err)
	}
	defer ns.Close()
	nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	vx, err := nl.LinkByName(sandbox.VXLANName(vni))
	if err != nil {
		nl.Close()
		t.Fatalf("%s: %v", h.name, err)
	}
	return nl, vx
}

func TestThreeHosts(t *testing.T) {
	nstest.RequireRoot(t)
	hosts := startCluster(t, 3)
	addrs := []netip.Prefix{netip.MustParsePrefix("198.51.100.10/24"), netip.MustParsePrefix("198.51.100.11/24"), netip.MustParsePrefix("198.51.100.12/24")}
	var ctrs []*nstest.NS
	for i, h := range hosts {
		ctrs = append(ctrs, h.join(t, fmt.Sprintf("ep%d", i), addrs[i]))
	}
	start := time.Now()
	for i := range hosts {
		for j := range hosts {
			if i == j {
				continue
			}
			if err := nstest.PingEventually(ctrs[i], addrs[j].Addr(), 15*time.Second); err != nil {
				t.Fatalf("host%d → host%d: %v", i, j, err)
			}
		}
	}
	t.Logf("all 6 pairs ping after %v", time.Since(start).Round(time.Millisecond))

	// Status shows three alive members and the two remote peers.
	st := hosts[0].status(t)
	members, _ := st["cluster"].(map[string]any)["members"].([]any)
	alive := 0
	for _, m := range members {
		if m.(map[string]any)["state"] == "alive" {
			alive++
		}
	}
	if alive != 3 {
		t.Fatalf("status: %d alive members, want 3: %v", alive, members)
	}
	nets, _ := st["driver"].(map[string]any)["networks"].([]any)
	if len(nets) != 1 || len(nets[0].(map[string]any)["remote_peers"].([]any)) != 2 {
		t.Fatalf("status: networks %v", nets)
	}

	// Key epochs: every host converges on epoch 1, then `overlayd keys
	// rotate` on one host moves the whole cluster to epoch 2 through the
	// three steps (accept, send, retire).
	keysEverywhere := func(want string) error {
		for _, h := range hosts {
			keys, _ := h.status(t)["member_keys"].(map[string]any)
			if len(keys) != len(hosts) {
				return fmt.Errorf("%s sees keys of %d members: %v", h.name, len(keys), keys)
			}
			for name, k := range keys {
				if k != want {
					return fmt.Errorf("%s sees %s at %v, want %s", h.name, name, k, want)
				}
			}
		}
		return nil
	}
	if err := nstest.Eventually(15*time.Second, 100*time.Millisecond, func() error { return keysEverywhere("accept=[1] send=1 target=1") }); err != nil {
		t.Fatal(err)
	}
	rotStart := time.Now()
	if out, err := exec.Command(binary(t), "keys", "rotate", "--control-socket", hosts[1].control()).CombinedOutput(); err != nil {
		t.Fatalf("overlayd keys rotate: %v\n%s", err, out)
	}
	if err := nstest.Eventually(20*time.Second, 100*time.Millisecond, func() error { return keysEverywhere("accept=[2] send=2 target=2") }); err != nil {
		t.Fatal(err)
	}
	t.Logf("key rotation 1 → 2 completed on all hosts after %v", time.Since(rotStart).Round(time.Millisecond))

	// Move 198.51.100.10 from host0 to host1: pings from host2 work again
	// quickly. (A second endpoint keeps host0's sandbox.)
	hosts[0].join(t, "ep0-second", netip.MustParsePrefix("198.51.100.13/24"))
	hosts[0].leave(t, "ep0")
	moved := time.Now()
	ctrMoved := hosts[1].join(t, "ep0-moved", addrs[0])
	_ = ctrMoved
	if err := nstest.PingEventually(ctrs[2], addrs[0].Addr(), 2*time.Second); err != nil {
		t.Fatalf("the moved IP is not reachable within 2 s: %v", err)
	}
	t.Logf("moved IP reachable again after %v", time.Since(moved).Round(time.Millisecond))

	// SIGKILL host2's overlayd: its peers leave host0's and host1's sandboxes.
	mac2 := ""
	if n, _ := hosts[0].neighbours(t); true {
		mac2 = n[addrs[2].Addr().String()]
	}
	if mac2 == "" {
		t.Fatal("host0 has no neighbour for host2's container")
	}
	killed := time.Now()
	hosts[2].cmd.Process.Signal(syscall.SIGKILL)
	hosts[2].cmd.Wait()
	for _, h := range hosts[:2] {
		err := nstest.Eventually(15*time.Second, 50*time.Millisecond, func() error {
			n, f := h.neighbours(t)
			if _, ok := n[addrs[2].Addr().String()]; ok {
				return fmt.Errorf("neighbour %s still programmed", addrs[2].Addr())
			}
			if _, ok := f[mac2]; ok {
				return fmt.Errorf("fdb %s still programmed", mac2)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%s after SIGKILL of host2: %v", h.name, err)
		}
		t.Logf("%s removed host2's peers %v after the kill", h.name, time.Since(killed).Round(time.Millisecond))
	}
}
