package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// startDaemon runs the daemon in-process on a temporary socket and returns
// an HTTP client that talks to it as dockerd does.
func startDaemon(t *testing.T, scope string) (*http.Client, func() error) {
	t.Helper()
	nstest.RequireRoot(t)
	return startDaemonIn(t, scope, t.TempDir(), nstest.NetnsDir(t), nstest.NewNS(t, "host"))
}

func startDaemonIn(t *testing.T, scope, dir, netnsDir string, host *nstest.NS, extra ...string) (*http.Client, func() error) {
	t.Helper()
	st, err := config.Parse(append([]string{
		"--socket", filepath.Join(dir, "plugins", "overlayd.sock"),
		"--state-dir", filepath.Join(dir, "state"),
		"--netns-dir", netnsDir,
		"--control-socket", filepath.Join(dir, "control.sock"),
		"--scope", scope,
	}, extra...), func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	go func() {
		// Run on a thread in a test namespace: the driver takes the
		// namespace it starts in as the host namespace, so every link it
		// makes lives in a namespace this test owns.
		err := netnsutil.DoIn(host.Handle, func() error { return Run(ctx, st, log) })
		if err != nil {
			t.Logf("daemon: %v", err)
		}
		done <- err
	}()
	if err := nstest.Eventually(5*time.Second, 10*time.Millisecond, func() error {
		select {
		case err := <-done:
			return fmt.Errorf("daemon exited: %v", err)
		default:
		}
		c, err := net.Dial("unix", st.Socket)
		if err == nil {
			c.Close()
		}
		return err
	}); err != nil {
		cancel()
		t.Fatalf("daemon did not serve: %v", err)
	}
	fi, err := os.Stat(st.Socket)
	if err != nil || fi.Mode().Perm() != 0o660 {
		t.Errorf("socket mode %v (err %v), want 0660", fi.Mode().Perm(), err)
	}
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", st.Socket)
	}}, Timeout: 10 * time.Second}
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			return fmt.Errorf("daemon did not stop")
		}
	}
	t.Cleanup(func() { stop() })
	return client, stop
}

func post(t *testing.T, c *http.Client, method string, body string) (int, map[string]interface{}) {
	t.Helper()
	resp, err := c.Post("http://plugin/"+method, "application/vnd.docker.plugins.v1.1+json", bytes.NewBufferString(body))
	if err != nil {
		t.Fatalf("%s: %v", method, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out map[string]interface{}
	json.Unmarshal(raw, &out)
	if out == nil {
		out = map[string]interface{}{"_raw": string(raw)}
	}
	return resp.StatusCode, out
}

func TestPluginAPIOverHTTP(t *testing.T) {
	for _, scope := range []string{"local", "global"} {
		t.Run(scope, func(t *testing.T) {
			c, stop := startDaemon(t, scope)
			code, out := post(t, c, "Plugin.Activate", "")
			if code != 200 || fmt.Sprint(out["Implements"]) != "[NetworkDriver IpamDriver]" {
				t.Fatalf("Activate: %d %v", code, out)
			}
			code, out = post(t, c, "NetworkDriver.GetCapabilities", "{}")
			if code != 200 || out["Scope"] != scope || out["ConnectivityScope"] != "global" {
				t.Fatalf("GetCapabilities: %d %v", code, out)
			}
			// Malformed JSON → 400.
			if code, _ := post(t, c, "NetworkDriver.CreateNetwork", "{not json"); code != 400 {
				t.Fatalf("malformed JSON: status %d, want 400", code)
			}
			// Unknown method → 404.
			if code, _ := post(t, c, "NetworkDriver.Frobnicate", "{}"); code != 404 {
				t.Fatalf("unknown method: status %d, want 404", code)
			}
			// A bad option comes back as an error naming it.
			code, out = post(t, c, "NetworkDriver.CreateNetwork", `{"NetworkID":"n1","Options":{"com.docker.network.generic":{"vni":"abc"}},"IPv4Data":[{"Pool":"192.0.2.0/24","Gateway":"192.0.2.1/24"}]}`)
			if code != 500 || !strings.Contains(fmt.Sprint(out["Err"]), "vni") {
				t.Fatalf("bad vni: %d %v", code, out)
			}
			// The full endpoint life cycle as dockerd drives it.
			steps := []struct{ method, body string }{
				{"NetworkDriver.CreateNetwork", `{"NetworkID":"n1","Options":{"com.docker.network.enable_ipv6":false,"com.docker.network.generic":{"vni":"4242"}},"IPv4Data":[{"AddressSpace":"LocalDefault","Pool":"192.0.2.0/24","Gateway":"192.0.2.1/24"}],"IPv6Data":[]}`},
				{"NetworkDriver.CreateEndpoint", `{"NetworkID":"n1","EndpointID":"e1","Interface":{"Address":"192.0.2.2/24","AddressIPv6":"","MacAddress":""},"Options":{}}`},
				{"NetworkDriver.Join", `{"NetworkID":"n1","EndpointID":"e1","SandboxKey":"/var/run/docker/netns/x","Options":{}}`},
				{"NetworkDriver.ProgramExternalConnectivity", `{"NetworkID":"n1","EndpointID":"e1","Options":{}}`},
				{"NetworkDriver.EndpointOperInfo", `{"NetworkID":"n1","EndpointID":"e1"}`},
				{"NetworkDriver.RevokeExternalConnectivity", `{"NetworkID":"n1","EndpointID":"e1"}`},
				{"NetworkDriver.Leave", `{"NetworkID":"n1","EndpointID":"e1"}`},
				{"NetworkDriver.DeleteEndpoint", `{"NetworkID":"n1","EndpointID":"e1"}`},
				{"NetworkDriver.DeleteNetwork", `{"NetworkID":"n1"}`},
				// Unknown ids after a restart: deletes succeed.
				{"NetworkDriver.Leave", `{"NetworkID":"gone","EndpointID":"e9"}`},
				{"NetworkDriver.DeleteEndpoint", `{"NetworkID":"gone","EndpointID":"e9"}`},
				{"NetworkDriver.DeleteNetwork", `{"NetworkID":"gone"}`},
				{"NetworkDriver.DiscoverNew", `{"DiscoveryType":1,"DiscoveryData":{"Address":"192.0.2.50","BindAddress":"0.0.0.0","Self":true}}`},
				{"NetworkDriver.DiscoverDelete", `{"DiscoveryType":1,"DiscoveryData":{"Address":"192.0.2.51","Self":false}}`},
				{"NetworkDriver.AllocateNetwork", `{"NetworkID":"swarm1","Options":{"mtu":"1400"},"IPv4Data":[{"Pool":"198.51.100.0/24"}]}`},
				{"NetworkDriver.FreeNetwork", `{"NetworkID":"swarm1"}`},
			}
			for _, s := range steps {
				code, out := post(t, c, s.method, s.body)
				if code != 200 {
					t.Fatalf("%s: status %d: %v", s.method, code, out)
				}
				switch s.method {
				case "NetworkDriver.CreateEndpoint":
					iface, _ := out["Interface"].(map[string]interface{})
					if iface["MacAddress"] != peerdb.MACFromEndpointID("e1").String() {
						t.Fatalf("CreateEndpoint: %v", out)
					}
				case "NetworkDriver.Join":
					in, _ := out["InterfaceName"].(map[string]interface{})
					if !strings.HasPrefix(fmt.Sprint(in["SrcName"]), "ovd") || in["DstPrefix"] != "eth" {
						t.Fatalf("Join: %v", out)
					}
				case "NetworkDriver.AllocateNetwork":
					opts, _ := out["Options"].(map[string]interface{})
					if opts["mtu"] != "1400" || opts["vni"] != "4096" {
						t.Fatalf("AllocateNetwork: %v", out)
					}
				}
			}
			// Unknown ids: Join fails clearly.
			code, out = post(t, c, "NetworkDriver.Join", `{"NetworkID":"gone","EndpointID":"e9"}`)
			if code != 500 || !strings.Contains(fmt.Sprint(out["Err"]), "not found") {
				t.Fatalf("Join on unknown network: %d %v", code, out)
			}
			if err := stop(); err != nil {
				t.Fatalf("shutdown: %v", err)
			}
		})
	}
}

// Shutdown waits for calls in flight and refuses new ones.
func TestGateDrains(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	g := &gate{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	go call0(g, "slow", func(int) error { close(entered); <-release; return nil }, 0)
	<-entered
	closeWaits(t, g, release)
	if err := call0(g, "late", func(int) error { return nil }, 0); err != errShuttingDown {
		t.Fatalf("call after close: %v", err)
	}
}

// closeWaits checks that g.close waits while a call is in flight (until
// release is closed) and returns once it ends.
func closeWaits(t *testing.T, g *gate, release chan struct{}) {
	t.Helper()
	closed := make(chan struct{})
	go func() { g.close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("close returned while a call was in flight")
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	<-closed
}

func TestStaleSocketReplacedLiveSocketRefused(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "x.sock")
	l, err := listen(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := listen(path); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("second listener on a live socket: %v", err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	l2, err := listen(path)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	l2.Close()
}

// State survives a restart of the daemon: dockerd's later calls for the
// endpoint it created before find it.
func TestRestartKeepsState(t *testing.T) {
	nstest.RequireRoot(t)
	dir, netnsDir, host := t.TempDir(), nstest.NetnsDir(t), nstest.NewNS(t, "host")
	c, stop := startDaemonIn(t, "local", dir, netnsDir, host)
	for _, s := range []struct{ method, body string }{
		{"NetworkDriver.CreateNetwork", `{"NetworkID":"n1","Options":{"com.docker.network.generic":{"vni":"4242"}},"IPv4Data":[{"Pool":"192.0.2.0/24","Gateway":"192.0.2.1/24"}]}`},
		{"NetworkDriver.CreateEndpoint", `{"NetworkID":"n1","EndpointID":"e1","Interface":{"Address":"192.0.2.2/24"}}`},
		{"NetworkDriver.Join", `{"NetworkID":"n1","EndpointID":"e1","SandboxKey":"/x"}`},
	} {
		if code, out := post(t, c, s.method, s.body); code != 200 {
			t.Fatalf("%s: %d %v", s.method, code, out)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	c, stop = startDaemonIn(t, "local", dir, netnsDir, host)
	code, out := post(t, c, "NetworkDriver.EndpointOperInfo", `{"NetworkID":"n1","EndpointID":"e1"}`)
	if code != 200 {
		t.Fatalf("endpoint forgotten across a restart: %d %v", code, out)
	}
	if code, out := post(t, c, "NetworkDriver.CreateNetwork", `{"NetworkID":"n2","Options":{"com.docker.network.generic":{"vni":"4242"}},"IPv4Data":[{"Pool":"198.51.100.0/24"}]}`); code != 500 || !strings.Contains(fmt.Sprint(out["Err"]), "already used") {
		t.Fatalf("VNI of the restored network reused: %d %v", code, out)
	}
	for _, s := range []struct{ method, body string }{
		{"NetworkDriver.Leave", `{"NetworkID":"n1","EndpointID":"e1"}`},
		{"NetworkDriver.DeleteEndpoint", `{"NetworkID":"n1","EndpointID":"e1"}`},
		{"NetworkDriver.DeleteNetwork", `{"NetworkID":"n1"}`},
	} {
		if code, out := post(t, c, s.method, s.body); code != 200 {
			t.Fatalf("%s: %d %v", s.method, code, out)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(netnsDir); len(entries) != 0 {
		t.Fatalf("sandboxes left: %v", entries)
	}
}

// A stop during start-up never leaves a control plane running: a start
// attempted after close (the retry loop, or a VTEP settled by a late
// DiscoverNew) does nothing. Before, tryStart did not know the plane was
// closed and started the cluster and the key manager anyway, leaking them.
func TestStartAfterStopDoesNothing(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t, "host")
	dir := t.TempDir()
	st, err := config.Parse([]string{"--state-dir", dir, "--node-name", "n1", "--gossip-port", "17947"}, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	err = netnsutil.DoIn(host.Handle, func() error {
		lo, err := host.NL.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := host.NL.LinkSetUp(lo); err != nil {
			return err
		}
		enc, err := encryption.NewOwner(encryption.OwnerConfig{NS: host.Handle, Port: 4799})
		if err != nil {
			return err
		}
		defer enc.Close()
		log := slog.New(slog.NewTextHandler(io.Discard, nil))
		link := newClusterLink(st, log, enc)
		d, err := driver.New(driver.Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: netip.MustParseAddr("127.0.0.1"),
			Peers: link, Publisher: link, Definitions: link, Membership: link})
		if err != nil {
			return err
		}
		defer d.Close()
		cp := newControlPlane(st, nil, log, make([]byte, 32), enc, nil, link, d, nil, nil)
		cp.done.Add(1)
		go cp.run()
		cp.close()
		cp.tryStart()
		link.VTEPChanged(netip.MustParseAddr("127.0.0.1"))
		if c := link.c.Load(); c != nil {
			c.Shutdown()
			return fmt.Errorf("the control plane started after it was stopped")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// A VTEP settled after the daemon started (swarm's DiscoverNew for this
// node) starts the control plane: the link, which knows no driver, wakes
// the control plane's loop, which starts the cluster with the driver's
// VTEP; a later change is announced by the running cluster at once.
func TestVTEPSettledStartsControlPlane(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t, "host")
	// Gossip on a loopback address of the test's namespace (memberlist's
	// sockets are made on any thread).
	st := &config.Settings{NodeName: "n1", GossipAddr: netip.MustParseAddr("127.0.0.1"), GossipPort: 17993}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	key := []byte("0123456789abcdef0123456789abcdef")
	enc, err := encryption.NewOwner(encryption.OwnerConfig{NS: host.Handle, Port: driver.DefaultVXLANPort, Secret: key,
		Logger: log, CheckKernel: func() error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(enc.Close)
	link := newClusterLink(st, log, enc)
	d, err := driver.New(driver.Config{Scope: "global", HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), Logger: log,
		Publisher: link, Peers: link, Definitions: link, Membership: link, Encryption: enc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	cp := newControlPlane(st, nil, log, key, enc, nil, link, d, nil, nil)
	cp.done.Add(1)
	go cp.run()
	t.Cleanup(cp.close)
	cp.tryStart() // as Run does: nothing without a VTEP
	if link.c.Load() != nil {
		t.Fatal("the control plane started without a VTEP")
	}
	self := func(addr string) {
		t.Helper()
		if err := d.DiscoverNew(&api.DiscoveryNotification{DiscoveryType: 1, DiscoveryData: map[string]interface{}{"Address": addr, "Self": true}}); err != nil {
			t.Fatal(err)
		}
	}
	first, second := netip.MustParseAddr("192.0.2.77"), netip.MustParseAddr("192.0.2.78")
	self(first.String())
	if err := nstest.Eventually(10*time.Second, 5*time.Millisecond, func() error {
		c := link.c.Load()
		if c == nil {
			return errors.New("the control plane has not started")
		}
		if v := c.VTEP(); v != first {
			return fmt.Errorf("the cluster announces VTEP %v, want %v", v, first)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	self(second.String())
	if v := link.c.Load().VTEP(); v != second {
		t.Fatalf("after the VTEP changed the cluster announces %v, want %v", v, second)
	}
}
