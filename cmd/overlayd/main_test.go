package main

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

func buildBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "overlayd")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func TestHelpListsSettings(t *testing.T) {
	bin := buildBinary(t)
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("--help: %v\n%s", err, out)
	}
	for _, want := range []string{"--socket", "OVERLAYD_SOCKET", "--state-dir", "--scope", "--advertise-addr", "--vxlan-port", "--netns-dir", "--log-level"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("--help lacks %s", want)
		}
	}
	cmd := exec.Command(bin, "--scope", "bogus")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err == nil || !strings.Contains(stderr.String(), "--scope") {
		t.Fatalf("bad flag: %v, stderr %q", err, stderr.String())
	}
}

// The daemon serves, logs to stdout, and on SIGTERM stops and exits 0.
func TestServeAndSIGTERM(t *testing.T) {
	nstest.RequireRoot(t)
	bin := buildBinary(t)
	dir := t.TempDir()
	nsPath := filepath.Join(dir, "hostns")
	ns, err := netnsutil.NewNamed(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	ns.Close()
	t.Cleanup(func() { netnsutil.RemoveNamed(nsPath) })
	sock := filepath.Join(dir, "overlayd.sock")
	cmd := exec.Command("nsenter", "--net="+nsPath, bin, "--socket", sock, "--state-dir", filepath.Join(dir, "state"),
		"--netns-dir", nstest.NetnsDir(t), "--control-socket", filepath.Join(dir, "control.sock"))
	cmd.Env = append(os.Environ(), "OVERLAYD_LOG_LEVEL=debug")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if err := nstest.Eventually(10*time.Second, 10*time.Millisecond, func() error {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
		}
		return err
	}); err != nil {
		t.Fatalf("socket never served: %v\nstdout: %s\nstderr: %s", err, stdout.String(), stderr.String())
	}
	// overlayd status talks to the control socket.
	out, err := exec.Command(bin, "status", "--control-socket", filepath.Join(dir, "control.sock")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "no networks") {
		t.Fatalf("overlayd status: %v\n%s", err, out)
	}
	out, err = exec.Command(bin, "status", "--json", "--control-socket", filepath.Join(dir, "control.sock")).CombinedOutput()
	if err != nil || !strings.Contains(string(out), `"driver"`) {
		t.Fatalf("overlayd status --json: %v\n%s", err, out)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\nstdout: %s\nstderr: %s", err, stdout.String(), stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("overlayd did not exit within 10 s of SIGTERM")
	}
	if !strings.Contains(stdout.String(), "overlayd serving") || !strings.Contains(stdout.String(), "overlayd stopped") {
		t.Errorf("logs not on stdout: %q", stdout.String())
	}
	if stderr.Len() != 0 {
		t.Errorf("unexpected stderr: %q", stderr.String())
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}
