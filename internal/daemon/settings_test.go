package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/logbuf"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// daemonRun is a daemon started by goDaemon.
type daemonRun struct {
	st   *config.Settings
	logs *logbuf.Buffer
	done chan error
	stop context.CancelFunc
}

// goDaemon runs the daemon in host (a test namespace) with args added to
// paths under dir, logging at debug into a buffer.
func goDaemon(t *testing.T, host *nstest.NS, dir string, args ...string) *daemonRun {
	t.Helper()
	base := []string{
		"--socket", filepath.Join(dir, "plugins", "overlayd.sock"),
		"--state-dir", filepath.Join(dir, "state"),
		"--netns-dir", nstest.NetnsDir(t),
		"--control-socket", filepath.Join(dir, "control.sock"),
		"--node-name", "n1",
	}
	st, err := config.Parse(append(base, args...), func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &daemonRun{st: st, logs: &logbuf.Buffer{}, done: make(chan error, 1), stop: cancel}
	log := slog.New(slog.NewTextHandler(r.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	go func() { r.done <- netnsutil.DoIn(host.Handle, func() error { return Run(ctx, st, log) }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
			t.Error("daemon did not stop")
		}
	})
	return r
}

// refused waits for the daemon to return and returns its error, failing
// the test if it serves instead.
func (r *daemonRun) refused(t *testing.T) error {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case err := <-r.done:
			r.done <- err // for the cleanup
			return err
		case <-deadline:
			t.Fatalf("the daemon neither served nor refused within 10 s; log:\n%s", r.logs)
		case <-time.After(10 * time.Millisecond):
			if c, err := net.Dial("unix", r.st.Socket); err == nil {
				c.Close()
				t.Fatalf("the daemon served; log:\n%s", r.logs)
			}
		}
	}
}

// A setting that does not fit the host, or an unusable key file, is
// refused as *config.Invalid before anything is created: no state
// directory, no key, no socket.
func TestRunRefusesSettingsThatDoNotFitTheHost(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t, "host")
	nstest.Underlay(t, host.NL, netip.MustParsePrefix("192.0.2.1/24"), false)
	keys := t.TempDir()
	readable := filepath.Join(keys, "readable.key")
	if err := os.WriteFile(readable, []byte("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		args []string
		want []string
	}{
		{"advertise address of another host", []string{"--advertise-addr", "203.0.113.9"},
			[]string{"--advertise-addr 203.0.113.9: not an address of this host (assigned here: 192.0.2.1)"}},
		{"gossip address of another host", []string{"--gossip-addr", "198.51.100.7"}, []string{"--gossip-addr 198.51.100.7"}},
		{"missing secret file", []string{"--secret-file", filepath.Join(keys, "typo", "cluster.key")}, []string{"--secret-file", "no such file", "must exist"}},
		{"group-readable key", []string{"--secret-file", readable},
			[]string{"mode 0640", "chmod 600 " + readable, "run chmod on the host", "'state' mount"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			r := goDaemon(t, host, dir, c.args...)
			err := r.refused(t)
			if _, ok := errors.AsType[*config.Invalid](err); !ok {
				t.Fatalf("Run = %v (%T), want a *config.Invalid", err, err)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("refusal %q lacks %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "cluster key: cluster key") {
				t.Errorf("doubled prefix: %q", err)
			}
			for _, p := range []string{r.st.StateDir, r.st.Socket, filepath.Join(keys, "typo")} {
				if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s exists after the refusal (%v)", p, err)
				}
			}
		})
	}
}

// Without an address the serving line says the VTEP is unknown (not
// vtep=""), a line says what will provide it, and once the default route
// has an address the VTEP is logged as settled. (The control plane's start
// on it is cmd/overlayd's test: in-process, the gossip would bind outside
// the test's namespace.)
func TestServingLineSaysWhatIsKnown(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t, "host")
	r := goDaemon(t, host, t.TempDir())
	if err := nstest.Eventually(10*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(r.logs.String(), "the control plane waits") {
			return errors.New("no waiting line yet")
		}
		return nil
	}); err != nil {
		t.Fatalf("%v; log:\n%s", err, r.logs)
	}
	logs := r.logs.String()
	serving := line(logs, `msg="overlayd serving"`)
	if serving == "" || strings.Contains(serving, `vtep=""`) || !strings.Contains(serving, `vtep="unknown yet"`) || !strings.Contains(serving, "version=") {
		t.Errorf("serving line %q: want the version and vtep=\"unknown yet\"", serving)
	}
	if w := line(logs, "the control plane waits"); !strings.Contains(w, "default route") || !strings.Contains(w, "--advertise-addr") {
		t.Errorf("waiting line %q does not say what provides the address", w)
	}
	nstest.Underlay(t, host.NL, netip.MustParsePrefix("192.0.2.1/24"), true)
	if err := nstest.Eventually(20*time.Second, 50*time.Millisecond, func() error {
		l := r.logs.String()
		if !strings.Contains(line(l, "local VTEP settled"), "vtep=192.0.2.1") {
			return errors.New("VTEP not logged as settled")
		}
		return nil
	}); err != nil {
		t.Fatalf("%v; log:\n%s", err, r.logs)
	}
}

// A control plane that cannot start (here: its gossip port is taken) is
// retried every second, but the failure is logged at ERROR once per
// distinct error, not every second; its start afterwards is logged.
func TestStartFailureLoggedOnce(t *testing.T) {
	nstest.RequireRoot(t)
	host := nstest.NewNS(t, "host")
	lo, err := host.NL.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := host.NL.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	// Take the port in the test's namespace and in the host's: the first
	// start runs on Run's thread (in the test's namespace), the retries on
	// the control plane's goroutine.
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	var takenNS net.Listener
	if err := netnsutil.DoIn(host.Handle, func() error {
		takenNS, err = net.Listen("tcp", taken.Addr().String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer takenNS.Close()
	r := goDaemon(t, host, t.TempDir(), "--advertise-addr", "127.0.0.1", "--gossip-port", strconv.Itoa(port))
	if err := nstest.Eventually(15*time.Second, 20*time.Millisecond, func() error {
		if n := strings.Count(r.logs.String(), "control plane still fails to start"); n < 2 {
			return fmt.Errorf("%d retries logged at debug", n)
		}
		return nil
	}); err != nil {
		t.Fatalf("%v; log:\n%s", err, r.logs)
	}
	if n := strings.Count(r.logs.String(), `level=ERROR msg="control plane failed to start`); n != 1 {
		t.Errorf("the start failure logged %d times at ERROR, want once; log:\n%s", n, r.logs)
	}
	taken.Close()
	takenNS.Close()
	if err := nstest.Eventually(15*time.Second, 20*time.Millisecond, func() error {
		if !strings.Contains(r.logs.String(), "control plane starts after failing") || !strings.Contains(r.logs.String(), `msg="control plane started"`) {
			return errors.New("no start logged")
		}
		return nil
	}); err != nil {
		t.Fatalf("%v; log:\n%s", err, r.logs)
	}
}
