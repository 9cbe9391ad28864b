// Package systemd holds the service unit of the legacy daemon
// (overlayd.service.in, installed by `make install`); its test checks what
// `make install` writes with systemd's own verifier.
package systemd

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestInstalledUnitVerifies runs `make install` into a temporary DESTDIR and
// `systemd-analyze verify` on the unit it wrote, inside that root (so that
// ExecStart must name the binary make installed there). Any message of the
// verifier fails the test: it reports unknown or misspelt settings only as
// warnings.
func TestInstalledUnitVerifies(t *testing.T) {
	analyze := ensureSystemdAnalyze(t)
	root := t.TempDir()
	repo, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	install := func() {
		t.Helper()
		cmd := exec.Command("make", "-C", repo, "install", "DESTDIR="+root, "BIN="+filepath.Join(root, "build", "overlayd"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("make install DESTDIR=%s: %v\n%s", root, err, out)
		}
	}
	install()

	const (
		unit     = "/usr/local/lib/systemd/system/overlayd.service"
		bin      = "/usr/local/bin/overlayd"
		defaults = "/etc/default/overlayd"
	)
	b, err := os.ReadFile(filepath.Join(root, unit))
	if err != nil {
		t.Fatalf("make install did not write the unit under DESTDIR: %v", err)
	}
	// Type=notify: overlayd says READY=1 once it serves, so the ordering
	// before docker.service means "serving", not just "forked".
	for _, want := range []string{"ExecStart=" + bin + "\n", "EnvironmentFile=-" + defaults + "\n", "Type=notify\n", "Before=docker.service\n"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("installed unit lacks %q:\n%s", strings.TrimSpace(want), b)
		}
	}
	if bytes.Contains(b, []byte("@")) {
		t.Errorf("installed unit has an unreplaced @...@ placeholder:\n%s", b)
	}
	if st, err := os.Stat(filepath.Join(root, bin)); err != nil || st.Mode().Perm() != 0o755 {
		t.Errorf("binary under DESTDIR: %v (mode %v), want mode 0755", err, st.Mode())
	}

	// The settings file is the operator's: a second install keeps it.
	mine := []byte("OVERLAYD_LOG_LEVEL=debug\n")
	if err := os.WriteFile(filepath.Join(root, defaults), mine, 0o644); err != nil {
		t.Fatal(err)
	}
	install()
	if got, _ := os.ReadFile(filepath.Join(root, defaults)); !bytes.Equal(got, mine) {
		t.Errorf("a second make install replaced the operator's %s: %q", defaults, got)
	}

	// The verifier follows the unit's dependencies (multi-user.target,
	// network-online.target, docker.service if installed): the system's
	// units go into the root with it.
	sysUnits := filepath.Join(root, "usr", "lib", "systemd")
	if err := os.MkdirAll(sysUnits, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-a", "/lib/systemd/system", sysUnits).CombinedOutput(); err != nil {
		t.Fatalf("copy the system's units: %v\n%s", err, out)
	}
	cmd := exec.Command(analyze, "verify", "--root="+root, unit)
	out, err := cmd.CombinedOutput()
	t.Logf("systemd-analyze verify %s (root %s): %v %s", unit, root, err, out)
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// ensureSystemdAnalyze returns the path of systemd-analyze, installing
// Debian's systemd package when it is missing (root only).
func ensureSystemdAnalyze(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("systemd-analyze"); err == nil {
		return p
	}
	if os.Geteuid() != 0 {
		t.Skip("systemd-analyze is missing and installing Debian's systemd package needs root")
	}
	for _, args := range [][]string{
		{"apt-get", "-q", "-o", "DPkg::Lock::Timeout=300", "update"},
		{"apt-get", "-q", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", "install", "systemd"},
	} {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	p, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze still missing after installing systemd: %v", err)
	}
	return p
}
