package docker

import (
	"bytes"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The suite needs these; installPackages installs what is missing.
const (
	busyboxBinary = "/bin/busybox"
	installLock   = "/run/lock/overlayd-test-install.lock"
	policyRCD     = "/usr/sbin/policy-rc.d"
)

// Where the engine's binaries are: Debian's docker.io puts dockerd in
// /usr/sbin, Docker's own packages in /usr/bin. The CLI is the packaged one
// in /usr/bin, whose API matches the engine (a static CLI in /usr/local/bin
// may be newer and negotiate down, with a few flags then refused).
var (
	dockerd   string
	dockerCLI string
)

// findEngine sets dockerd and dockerCLI and reports whether an engine
// (dockerd, CLI, containerd, runc) is installed.
func findEngine() bool {
	first := func(paths ...string) string {
		for _, p := range paths {
			if st, err := os.Stat(p); err == nil && !st.IsDir() {
				return p
			}
		}
		return ""
	}
	dockerd = first("/usr/sbin/dockerd", "/usr/bin/dockerd")
	dockerCLI = first("/usr/bin/docker")
	return dockerd != "" && dockerCLI != "" &&
		first("/usr/bin/containerd", "/usr/sbin/containerd") != "" &&
		first("/usr/sbin/runc", "/usr/bin/runc") != ""
}

var (
	installOnce sync.Once
	installErr  error
	installTook time.Duration
)

// ensureInstalled installs the selected engine's system packages and
// busybox-static once per test binary.
// Test binaries of several packages may run at once: a file lock serialises
// them, and each re-checks after taking it.
func ensureInstalled() error {
	installOnce.Do(func() {
		start := time.Now()
		installErr = installPackages()
		installTook = time.Since(start)
	})
	return installErr
}

// missingPackages lists the Debian packages to install: the engine's (a
// fetched engine needs only the system's runc, and iptables for dockerd's
// firewall) and busybox-static.
func missingPackages() []string {
	var need []string
	if selected.suite != "" {
		if _, err := exec.LookPath("runc"); err != nil {
			need = append(need, "runc")
		}
		if _, err := exec.LookPath("iptables"); err != nil {
			need = append(need, "iptables")
		}
	} else if !findEngine() {
		need = append(need, "docker.io")
	}
	if !isStaticELF(busyboxBinary) {
		need = append(need, "busybox-static")
	}
	return need
}

// isStaticELF reports whether path is an ELF executable without an
// interpreter (a busybox that runs in an empty image).
func isStaticELF(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return false
		}
	}
	return true
}

func installPackages() error { return aptInstall(missingPackages) }

// aptInstall installs the Debian packages missing() lists, under the
// suite's install lock, without letting them start services.
func aptInstall(missing func() []string) error {
	if len(missing()) == 0 {
		return nil
	}
	lf, err := os.OpenFile(installLock, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("install lock: %w", err)
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("install lock %s: %w", installLock, err)
	}
	defer unix.Flock(int(lf.Fd()), unix.LOCK_UN)
	need := missing() // another binary may have installed them meanwhile
	if len(need) == 0 {
		return nil
	}
	// Keep the package scripts from starting a system dockerd (docker.io
	// enables and starts docker.service): the suite runs its own engines,
	// and a system daemon would change the root namespace's firewall
	// (FORWARD policy DROP) under other tests. policy-rc.d is Debian's
	// switch for that; an existing one is left alone.
	if _, err := os.Lstat(policyRCD); os.IsNotExist(err) {
		if err := os.WriteFile(policyRCD, []byte("#!/bin/sh\n# written by overlayd's test suite during apt-get install; removed afterwards\nexit 101\n"), 0o755); err != nil {
			return fmt.Errorf("write %s: %w", policyRCD, err)
		}
		defer os.Remove(policyRCD)
	}
	env := append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	run := func(args ...string) error {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s: %v\n%s", strings.Join(args, " "), err, tail(out.String(), 40))
		}
		return nil
	}
	if err := run("apt-get", "-q", "-o", "DPkg::Lock::Timeout=300", "update"); err != nil {
		return err
	}
	// --no-remove: never let busybox-static replace a dynamic busybox (or
	// anything else) silently; fail instead.
	args := append([]string{"apt-get", "-q", "-y", "--no-install-recommends", "--no-remove",
		"-o", "DPkg::Lock::Timeout=300", "install"}, need...)
	if err := run(args...); err != nil {
		return err
	}
	if left := missing(); len(left) > 0 {
		return fmt.Errorf("still missing after apt-get install: %v", left)
	}
	return nil
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
