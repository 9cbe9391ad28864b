package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// runBin runs the binary and returns its exit status, stdout and stderr.
// A command that has not exited after 20 s (a daemon serving when it should
// have refused) is killed and fails the test.
func runBin(t *testing.T, bin string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Errorf("%s %v did not exit within 20 s; killed. stdout: %s\nstderr: %s", bin, args, stdout.String(), stderr.String())
		return -1, stdout.String(), stderr.String()
	}
	code := 0
	if ee, ok := errors.AsType[*exec.ExitError](err); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%s %v: %v", bin, args, err)
	}
	return code, stdout.String(), stderr.String()
}

// oneLine checks that stderr is exactly one line with every want in it,
// and no usage text.
func oneLine(t *testing.T, what, stderr string, want ...string) {
	t.Helper()
	if strings.Count(stderr, "\n") != 1 || !strings.HasSuffix(stderr, "\n") {
		t.Errorf("%s: stderr is not one line: %q", what, stderr)
	}
	if strings.Contains(stderr, "Usage") || strings.Contains(stderr, "Flags") {
		t.Errorf("%s: stderr carries the usage text: %q", what, stderr)
	}
	for _, w := range want {
		if !strings.Contains(stderr, w) {
			t.Errorf("%s: stderr %q lacks %q", what, stderr, w)
		}
	}
}

// hostNS makes a named network namespace (for nsenter) with an underlay
// address and, if route, an IPv4 default route through it.
func hostNS(t *testing.T, addr string, route bool) string {
	t.Helper()
	nstest.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "hostns")
	ns, err := netnsutil.NewNamed(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { netnsutil.RemoveNamed(path) })
	defer ns.Close()
	nl, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	nstest.Underlay(t, nl, netip.MustParsePrefix(addr), route)
	return path
}

// daemonArgs returns the flags that keep a daemon's files under dir.
func daemonArgs(t *testing.T, dir string) []string {
	return []string{"--socket", filepath.Join(dir, "overlayd.sock"), "--state-dir", filepath.Join(dir, "state"),
		"--netns-dir", nstest.NetnsDir(t), "--control-socket", filepath.Join(dir, "control.sock"), "--node-name", "h1"}
}

// A bad setting is one line on stderr naming it, without the usage text,
// and exit status 2: from the command line, from the environment (a
// managed plugin's settings), and when it does not fit the host.
func TestBadSettingIsOneLineAndExit2(t *testing.T) {
	bin := buildBinary(t)
	code, stdout, stderr := runBin(t, bin, "--scope", "bogus", "--vxlan-port", "0")
	if code != 2 || stdout != "" {
		t.Errorf("--scope bogus: exit %d, stdout %q; want 2 and nothing", code, stdout)
	}
	oneLine(t, "--scope bogus", stderr, `overlayd: --scope "bogus": must be local or global`, `--vxlan-port "0"`)
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "OVERLAYD_LOG_LEVEL=loud")
	var eb bytes.Buffer
	cmd.Stderr = &eb
	if err := cmd.Run(); err == nil || cmd.ProcessState.ExitCode() != 2 {
		t.Errorf("$OVERLAYD_LOG_LEVEL=loud: %v, want exit 2", err)
	}
	oneLine(t, "$OVERLAYD_LOG_LEVEL=loud", eb.String(), `$OVERLAYD_LOG_LEVEL "loud"`)
	code, stdout, stderr = runBin(t, bin, "--metrics-addr", "localhost:9447")
	if code != 2 || stdout != "" {
		t.Errorf("--metrics-addr localhost:9447: exit %d, stdout %q; want 2 and nothing", code, stdout)
	}
	oneLine(t, "--metrics-addr localhost:9447", stderr, `overlayd: --metrics-addr "localhost:9447": "localhost" is not an IP address: must be IP:port`)

	if os.Geteuid() != 0 {
		return
	}
	ns := hostNS(t, "192.0.2.1/24", false)
	keyDir := t.TempDir()
	readable := filepath.Join(keyDir, "cluster.key")
	if err := os.WriteFile(readable, []byte("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"--advertise-addr", "203.0.113.9"}, []string{"overlayd: --advertise-addr 203.0.113.9: not an address of this host (assigned here: 192.0.2.1)"}},
		{[]string{"--secret-file", filepath.Join(keyDir, "typo.key")}, []string{"--secret-file", "no such file"}},
		{[]string{"--secret-file", readable}, []string{"mode 0644", "chmod 600 " + readable, "'state' mount"}},
		// Well-formed but not bindable here: refused before anything is
		// created, not a daemon serving without its metrics.
		{[]string{"--metrics-addr", "203.0.113.9:9447"}, []string{`overlayd: --metrics-addr "203.0.113.9:9447": cannot listen there`, "leave it unset"}},
	} {
		dir := t.TempDir()
		code, stdout, stderr := runBin(t, "nsenter", append([]string{"--net=" + ns, bin}, append(daemonArgs(t, dir), c.args...)...)...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2; stdout %q", c.args, code, stdout)
		}
		oneLine(t, strings.Join(c.args, " "), stderr, c.want...)
		if _, err := os.Stat(filepath.Join(dir, "state")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%v: state directory created before the refusal (%v)", c.args, err)
		}
	}
}

func TestVersion(t *testing.T) {
	bin := buildBinary(t)
	for _, args := range [][]string{{"version"}, {"--version"}} {
		code, stdout, _ := runBin(t, bin, args...)
		if code != 0 || !strings.HasPrefix(stdout, "overlayd ") || strings.Count(stdout, "\n") != 1 {
			t.Errorf("%v: exit %d, %q", args, code, stdout)
		}
	}
	// make build stamps the version from git through -ldflags.
	stamped := filepath.Join(t.TempDir(), "overlayd")
	if out, err := exec.Command("go", "build", "-ldflags", "-X github.com/overlayd/overlayd/internal/version.stamp=v9.9.9-test", "-o", stamped, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if code, stdout, _ := runBin(t, stamped, "version"); code != 0 || !strings.HasPrefix(stdout, "overlayd v9.9.9-test (go") {
		t.Errorf("stamped version: exit %d, %q", code, stdout)
	}
}

// The client commands have a --help in --help's style (exit 0, stdout)
// naming the environment variables; misuse is one line and exit 2.
func TestClientCommandsHelp(t *testing.T) {
	bin := buildBinary(t)
	for _, args := range [][]string{{"status", "--help"}, {"keys", "--help"}, {"keys", "rotate", "--help"}, {"leave", "-h"}, {"help", "status"}, {"ipam", "--help"}, {"ipam", "reclaim", "--help"}, {"help", "ipam"}} {
		name := args[0]
		if name == "help" {
			name = args[1]
		}
		code, stdout, stderr := runBin(t, bin, args...)
		if code != 0 || stderr != "" || !strings.Contains(stdout, "Usage: overlayd "+name) {
			t.Errorf("%v: exit %d, stderr %q, stdout %q", args, code, stderr, stdout)
		}
		if !strings.Contains(stdout, "$OVERLAYD_CONTROL_SOCKET") || !strings.Contains(stdout, "Flags (each also read from its environment variable") {
			t.Errorf("%v: usage lacks the environment variable:\n%s", args, stdout)
		}
	}
	for _, args := range [][]string{{"keys"}, {"keys", "spin"}, {"status", "--bogus"}, {"status", "extra"}, {"ipam"}, {"ipam", "spin"}} {
		code, _, stderr := runBin(t, bin, args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
		oneLine(t, strings.Join(args, " "), stderr, "overlayd "+args[0]+":", "--help")
	}
	for _, args := range [][]string{{"ipam", "reclaim"}, {"ipam", "reclaim", "h3", "h4"}} {
		code, _, stderr := runBin(t, bin, args...)
		if code != 2 {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
		oneLine(t, strings.Join(args, " "), stderr, "overlayd ipam reclaim:", "--help")
	}
	code, _, stderr := runBin(t, bin, "status", "--control-socket", filepath.Join(t.TempDir(), "none.sock"))
	if code != 1 {
		t.Errorf("status without a daemon: exit %d, want 1", code)
	}
	oneLine(t, "status without a daemon", stderr, "overlayd status: cannot reach overlayd's control socket", "no such file or directory")
	if strings.Contains(stderr, "dial unix") || strings.Contains(stderr, "http://") {
		t.Errorf("status without a daemon repeats its context: %q", stderr)
	}
}

// `overlayd keys rotate` exits 1 with the reason when the rotation cannot
// run: here after `overlayd leave` (the key owner kept its gossip, and a
// rotation nobody would carry was reported as started).
func TestKeysRotateFailsWhenItCannotRun(t *testing.T) {
	bin := buildBinary(t)
	ns := hostNS(t, "192.0.2.1/24", true)
	dir := t.TempDir()
	cmd := exec.Command("nsenter", append([]string{"--net=" + ns, bin}, daemonArgs(t, dir)...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ctl := filepath.Join(dir, "control.sock")
	if err := nstest.Eventually(15*time.Second, 50*time.Millisecond, func() error {
		out, err := exec.Command(bin, "status", "--json", "--control-socket", ctl).Output()
		if err != nil {
			return err
		}
		if !strings.Contains(string(out), `"cluster"`) {
			return errors.New("control plane not started")
		}
		return nil
	}); err != nil {
		t.Fatalf("%v\nstdout: %s\nstderr: %s", err, stdout.String(), stderr.String())
	}
	if code, out, errOut := runBin(t, bin, "leave", "--control-socket", ctl); code != 0 {
		t.Fatalf("leave: exit %d: %s %s", code, out, errOut)
	}
	code, out, errOut := runBin(t, bin, "keys", "rotate", "--control-socket", ctl)
	if code != 1 || out != "" {
		t.Errorf("keys rotate after leave: exit %d, stdout %q; want 1 and nothing", code, out)
	}
	oneLine(t, "keys rotate after leave", errOut, "overlayd keys rotate: key rotation cannot run: this host left the cluster")
	if _, err := net.Dial("unix", filepath.Join(dir, "overlayd.sock")); err != nil {
		t.Errorf("the plugin stopped serving after leave: %v", err)
	}
}

// A state file the daemon cannot trust stops the start with one line on
// stderr naming the file, what is wrong and what to do, exit status 1, and
// no traceback: a file cut short (bbolt faulted on it: a Go traceback and
// exit 2), and an older copy put in place of the newest (it started and
// forgot the newest network).
func TestUntrustedStateFileIsOneLineAndExit1(t *testing.T) {
	nstest.RequireRoot(t)
	bin := buildBinary(t)
	ns := hostNS(t, "192.0.2.1/24", false)
	for _, c := range []struct {
		name   string
		damage func(t *testing.T, path string, older []byte)
		want   []string
	}{
		{"truncated", func(t *testing.T, path string, _ []byte) {
			// Two pages: the meta pages, and none of the pages they
			// refer to.
			if err := os.Truncate(path, 8192); err != nil {
				t.Fatal(err)
			}
		}, []string{" is truncated: 8192 of the ", "restore the file from a backup"}},
		{"an older copy", func(t *testing.T, path string, older []byte) {
			if err := os.WriteFile(path, older, 0o600); err != nil {
				t.Fatal(err)
			}
		}, []string{" an older copy of the file is in its place", "rm " + "STATE.txid"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			state := filepath.Join(dir, "state")
			path := filepath.Join(state, statefile.FileName)
			sf, err := statefile.Open(state)
			if err != nil {
				t.Fatal(err)
			}
			older, err := os.ReadFile(path) // no network yet
			if err != nil {
				t.Fatal(err)
			}
			if err := sf.PutNetwork(statefile.Network{ID: "n1", VNIs: []uint32{5}, Pools: []string{"10.10.0.0/24"}, Gateways: []string{""}, MTU: 1450}); err != nil {
				t.Fatal(err)
			}
			sf.Close()
			c.damage(t, path, older)
			code, stdout, stderr := runBin(t, "nsenter", append([]string{"--net=" + ns, bin}, daemonArgs(t, dir)...)...)
			if code != 1 {
				t.Errorf("exit %d, want 1", code)
			}
			want := []string{"overlayd: state file " + path + " ", "overlayd refuses to start"}
			for _, w := range c.want {
				want = append(want, strings.ReplaceAll(w, "STATE", path))
			}
			oneLine(t, c.name, stderr, want...)
			for _, trace := range []string{"goroutine ", "panic", "fatal error", "unexpected fault address", "SIGBUS", "SIGSEGV"} {
				if strings.Contains(stdout+stderr, trace) {
					t.Errorf("output has %q: stdout %q, stderr %q", trace, stdout, stderr)
				}
			}
		})
	}
}
