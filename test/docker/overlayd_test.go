package docker

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"time"
)

// overlaydProc is a legacy-plugin overlayd serving one engine: it runs in the
// engine's network namespace and the host's mount namespace, listens where
// that engine's dockerd looks for legacy plugins, and keeps its state and
// sandbox namespaces (and its control socket) in the engine's directory.
type overlaydProc struct {
	e        *engine
	socket   string
	stateDir string
	netnsDir string
	control  string
	logPath  string
	args     []string

	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
	log     *os.File
}

// startOverlayd starts overlayd (scope local unless extra says otherwise) for
// the engine and waits for its socket.
func (e *engine) startOverlayd(extra ...string) *overlaydProc {
	e.t.Helper()
	return e.startOverlaydAt(filepath.Join(e.pluginDir, "overlayd.sock"), extra...)
}

// startOverlaydAt is startOverlayd with overlayd listening on socket (e.g.
// behind a recorder, see recordPluginCalls).
func (e *engine) startOverlaydAt(socket string, extra ...string) *overlaydProc {
	e.t.Helper()
	o := &overlaydProc{e: e,
		socket:   socket,
		stateDir: filepath.Join(e.dir, "ovd", "state"),
		netnsDir: filepath.Join(e.dir, "ovd", "netns"),
		control:  filepath.Join(e.dir, "ovd", "control.sock"),
		logPath:  filepath.Join(e.dir, "overlayd.log"),
	}
	o.args = append([]string{
		"--socket", o.socket,
		"--state-dir", o.stateDir,
		"--netns-dir", o.netnsDir,
		"--advertise-addr", e.addr.String(),
		"--log-level", "debug",
		// Not the defaults in the host's /run/overlayd, and one per engine.
		"--control-socket", o.control,
		"--node-name", e.name,
		// This engine's API, and resolvers of the lab's own (a test
		// writes the file when it needs one): never the host's.
		"--engine-socket", e.sock,
		"--resolv-conf", filepath.Join(e.dir, "ovd-resolv.conf"),
	}, extra...)
	// Networks defined once only where a test asks for them: the other
	// tests create each network on every engine themselves, which
	// netsync's replicas would race ("already exists").
	if !slices.Contains(extra, "--netsync") {
		o.args = append(o.args, "--netsync", "off")
	}
	e.ovd = o
	if err := o.start(); err != nil {
		e.t.Fatalf("engine %s: %v", e.name, err)
	}
	return o
}

func (o *overlaydProc) start() error {
	lf, err := os.OpenFile(o.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	o.log = lf
	cmd := exec.Command("nsenter", append([]string{"--net=/proc/self/fd/3", "--", overlayd}, o.args...)...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.ExtraFiles = []*os.File{o.e.ns.file}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		lf.Close()
		return fmt.Errorf("start overlayd: %w", err)
	}
	o.cmd = cmd
	o.done = make(chan struct{})
	go func() {
		o.waitErr = cmd.Wait()
		close(o.done)
	}()
	for {
		if c, err := net.Dial("unix", o.socket); err == nil {
			c.Close()
			o.e.t.Logf("engine %s: overlayd serving %v after start", o.e.name, time.Since(start).Round(time.Millisecond))
			return nil
		}
		select {
		case <-o.done:
			return fmt.Errorf("overlayd exited (%v):\n%s", o.waitErr, o.logTail(20))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Since(start) > 10*time.Second {
			return fmt.Errorf("overlayd socket %s not ready after 10s:\n%s", o.socket, o.logTail(20))
		}
	}
}

func (o *overlaydProc) running() bool {
	if o.done == nil {
		return false
	}
	select {
	case <-o.done:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM and expects overlayd to exit 0 within 10s (else kills
// it and says so).
func (o *overlaydProc) stop() error {
	if !o.running() {
		return nil
	}
	o.cmd.Process.Signal(syscall.SIGTERM)
	defer o.log.Close()
	select {
	case <-o.done:
		if o.waitErr != nil {
			return fmt.Errorf("overlayd exit after SIGTERM: %v", o.waitErr)
		}
		return nil
	case <-time.After(10 * time.Second):
		o.cmd.Process.Kill()
		<-o.done
		return fmt.Errorf("overlayd did not stop within 10s of SIGTERM; killed")
	}
}

func (o *overlaydProc) logTail(n int) string {
	b, _ := os.ReadFile(o.logPath)
	return tail(string(b), n)
}

// sandboxes lists the sandbox namespace files in overlayd's netns dir and the
// mounts under it (host mount namespace).
func (o *overlaydProc) sandboxes() (files, mounts []string) {
	ents, _ := os.ReadDir(o.netnsDir)
	for _, e := range ents {
		files = append(files, e.Name())
	}
	// The netns directory itself is a (shared) mount overlayd makes; only
	// sandboxes below it count.
	return files, sandboxesIn(mountsUnder(o.netnsDir), o.netnsDir)
}

// status runs `overlayd status --json` against this overlayd.
func (o *overlaydProc) status() (string, error) {
	out, err := exec.Command(overlayd, "status", "--json", "--control-socket", o.control).CombinedOutput()
	return string(out), err
}
