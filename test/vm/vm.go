// Package vm boots Debian's cloud kernel under qemu with a busybox
// initramfs and runs static test binaries inside it: the way overlayd tests
// what this machine's own kernel cannot do (ESP/AEAD states).
//
// How a run works:
//
//   - EnsureTools installs qemu-system-x86 and busybox-static with apt-get
//     when missing (root only).
//   - FetchKernel `apt-get download`s the kernel image package that
//     linux-image-cloud-amd64 depends on and unpacks it with `dpkg-deb -x`
//     into the cache (never installing it on the host); it is reused until
//     Debian ships a newer one.
//   - Run resolves the requested modules and their dependencies from the
//     modules' .modinfo (depends=, softdep pre:), skipping built-ins, and
//     writes an uncompressed cpio initramfs holding busybox, /init, the
//     modules and the payload binaries.
//   - qemu boots it (-M pc -cpu max -m 512 -nographic -no-reboot, KVM when
//     asked for, else TCG). /init loads the modules, runs each payload
//     and writes "EXIT <name> <status>" to the second serial port, which
//     qemu saves to a file, then "DONE", and powers off. The console (first
//     serial port) streams live.
//   - Failures are distinct: ErrTimeout (the VM did not finish in time and
//     was killed), ErrPanic (the guest kernel panicked: panic=-1 plus
//     -no-reboot make qemu exit), ErrNoStatus (the guest stopped without
//     reporting), and a payload's non-zero exit status.
//
// The cache ($OVERLAYD_VM_CACHE, default ~/.cache/overlayd-vm) keeps the
// extracted kernel (about 100 MB; older ones are removed when Debian ships
// a new one) and the last console log; the initramfs is rebuilt on every
// run (under a second). TestVM (go test ./test/vm/...) builds the guest
// suites with CGO_ENABLED=0 go test -c and runs them; vmexec runs any
// package's tests in the VM through go test -exec.
package vm

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"
)

var (
	ErrTimeout  = errors.New("vm: timed out (VM killed)")
	ErrPanic    = errors.New("vm: guest kernel panicked")
	ErrNoStatus = errors.New("vm: guest stopped without reporting an exit status")
)

// Binary is a payload program: copied to /payload/<Name> and run from
// /payload with Args.
type Binary struct {
	Name string
	Path string // on the host
	Args []string
}

// Options configure one VM run.
type Options struct {
	Kernel          *Kernel
	Modules         []string // required modules (dependencies are added)
	OptionalModules []string // loaded when present (e.g. CPU-specific crypto)
	Binaries        []Binary
	Env             map[string]string // exported before the payloads run
	MemoryMB        int               // default 512
	Timeout         time.Duration     // default 5 minutes
	Console         io.Writer         // live console output, or nil
	WorkDir         string            // where the initramfs and status file go (default: a temporary directory)
	Accel           string            // qemu accelerator; default $OVERLAYD_VM_ACCEL, else "tcg"
	Append          string            // extra kernel command line
}

// Result is the outcome of a run that reported a status.
type Result struct {
	Exits    map[string]int // payload name -> exit status
	Console  string
	Boot     time.Duration // qemu start to the first payload start
	Total    time.Duration // qemu start to qemu exit
	Accel    string
	Initramf int64 // initramfs size in bytes
}

// Failed returns the payloads that exited non-zero.
func (r *Result) Failed() []string {
	var out []string
	for n, rc := range r.Exits {
		if rc != 0 {
			out = append(out, fmt.Sprintf("%s (exit %d)", n, rc))
		}
	}
	return out
}

// GuestModules are the modules the guest tests need, in load order (some
// need others loaded first without naming them as dependencies).
var GuestModules = []string{
	"xfrm_user", "esp4", "esp6", // xfrm netlink, ESP for IPv4 and IPv6
	"gcm", "ghash_generic", "ctr", "seqiv", "echainiv", // rfc4106(gcm(aes)) and its IV generator
	"sha3_generic", "sha512_generic", "drbg", "jitterentropy_rng", // the crypto RNG ESP needs (drbg's default is hmac(sha512))
	"vxlan", "veth", "bridge", // data plane
	"nfnetlink", "nf_tables", // firewall (rt ipsec, meta secpath, sets, route chains are in nf_tables)
}

// GuestOptionalModules speed up crypto where the (emulated) CPU allows.
var GuestOptionalModules = []string{"aesni_intel", "ghash_clmulni_intel"}

const marker = "OVERLAYD-VM:"

var safeName = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func initScript(o *Options, modules []string) string {
	var b strings.Builder
	b.WriteString(`#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /sbin /usr/bin /usr/sbin
/bin/busybox mount -t proc proc /proc
/bin/busybox --install -s
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
echo "` + marker + ` kernel $(uname -r) up at $(cut -d' ' -f1 /proc/uptime)s"
while read -r kind m; do
  if ! insmod "$m" 2>/tmp/insmod.err; then
    if [ "$kind" = req ] && ! grep -q 'File exists' /tmp/insmod.err; then
      echo "` + marker + ` insmod $m failed: $(cat /tmp/insmod.err)"
    fi
  fi
done < /modules.list
echo "` + marker + ` modules loaded at $(cut -d' ' -f1 /proc/uptime)s"
ip link set lo up 2>/dev/null
`)
	for k, v := range o.Env {
		fmt.Fprintf(&b, "export %s=%s\n", k, shellQuote(v))
	}
	b.WriteString("cd /payload\n")
	for _, bin := range o.Binaries {
		args := ""
		for _, a := range bin.Args {
			args += " " + shellQuote(a)
		}
		fmt.Fprintf(&b, "echo \"%s start %s at $(cut -d' ' -f1 /proc/uptime)s\"\n", marker, bin.Name)
		fmt.Fprintf(&b, "./%s%s </dev/null\nrc=$?\n", bin.Name, args)
		fmt.Fprintf(&b, "echo \"%s end %s status $rc at $(cut -d' ' -f1 /proc/uptime)s\"\n", marker, bin.Name)
		fmt.Fprintf(&b, "echo \"EXIT %s $rc\" > /dev/ttyS1\n", bin.Name)
	}
	b.WriteString("echo DONE > /dev/ttyS1\n")
	// Let the console drain before powering off, or the last lines are lost.
	b.WriteString("sleep 0.3\nsync\npoweroff -f\n")
	return b.String()
}

// Run boots the VM and runs the payloads. It returns a Result when the guest
// reported its status (check Result.Exits), or ErrTimeout, ErrPanic or
// ErrNoStatus (wrapped, with the console tail), or an error preparing the
// VM.
func Run(ctx context.Context, o Options) (*Result, error) {
	if o.Kernel == nil {
		return nil, errors.New("vm: no kernel")
	}
	if o.MemoryMB == 0 {
		o.MemoryMB = 512
	}
	if o.Timeout == 0 {
		o.Timeout = 5 * time.Minute
	}
	if o.Accel == "" {
		// Software emulation by default: nested KVM, where /dev/kvm exists
		// at all, proved unreliable (qemu aborts setting MSRs, or hangs).
		o.Accel = os.Getenv("OVERLAYD_VM_ACCEL")
		if o.Accel == "" {
			o.Accel = "tcg"
		}
	}
	work := o.WorkDir
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("", "overlayd-vm-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(work)
	}
	mods, err := o.Kernel.ResolveModules(o.Modules, o.OptionalModules)
	if err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	reqSet := map[string]bool{}
	if req, err := o.Kernel.ResolveModules(o.Modules, nil); err == nil {
		for _, m := range req {
			reqSet[m] = true
		}
	}
	fs := newInitramfs()
	fs.addFile("bin/busybox", 0o755, BusyboxPath)
	fs.addCharDev("dev/console", 5, 1)
	for _, d := range []string{"proc", "sys", "tmp", "run", "etc", "payload"} {
		fs.mkdirAll(d)
	}
	var list strings.Builder
	for _, m := range mods {
		rel, err := filepath.Rel(o.Kernel.ModDir, m)
		if err != nil {
			return nil, err
		}
		guest := "/lib/modules/" + o.Kernel.Release + "/" + filepath.ToSlash(rel)
		fs.addFile(guest, 0o644, m)
		kind := "opt"
		if reqSet[m] {
			kind = "req"
		}
		fmt.Fprintf(&list, "%s %s\n", kind, guest)
	}
	fs.addData("modules.list", 0o644, []byte(list.String()))
	for _, bin := range o.Binaries {
		if !safeName.MatchString(bin.Name) {
			return nil, fmt.Errorf("vm: bad payload name %q", bin.Name)
		}
		fs.addFile("payload/"+bin.Name, 0o755, bin.Path)
	}
	fs.addData("init", 0o755, []byte(initScript(&o, mods)))
	initrd := filepath.Join(work, "initramfs.cpio")
	size, err := fs.writeFile(initrd)
	if err != nil {
		return nil, fmt.Errorf("vm: writing initramfs: %w", err)
	}
	status := filepath.Join(work, "status")
	os.Remove(status)

	cmdline := "console=ttyS0 panic=-1 quiet cryptomgr.notests=1"
	if o.Append != "" {
		cmdline += " " + o.Append
	}
	cpu := "max"
	if strings.HasPrefix(o.Accel, "kvm") {
		cpu = "host"
	}
	args := []string{
		"-M", "pc,accel=" + o.Accel, "-cpu", cpu, "-m", strconv.Itoa(o.MemoryMB),
		"-nographic", "-nodefaults", "-no-reboot", "-monitor", "none",
		"-serial", "stdio", "-serial", "file:" + status,
		"-kernel", o.Kernel.Vmlinuz, "-initrd", initrd, "-append", cmdline,
	}
	tctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	cmd := exec.CommandContext(tctx, "qemu-system-x86_64", args...)
	cmd.Stdin = nil
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("vm: starting qemu: %w", err)
	}
	res := &Result{Exits: map[string]int{}, Accel: o.Accel, Initramf: size}
	var console bytes.Buffer
	var mu sync.Mutex
	done := make(chan struct{})
	go func() {
		defer close(done)
		r := bufio.NewReader(stdout)
		for {
			line, err := r.ReadString('\n')
			if line != "" {
				mu.Lock()
				console.WriteString(line)
				if res.Boot == 0 && strings.Contains(line, marker+" start ") {
					res.Boot = time.Since(start)
				}
				mu.Unlock()
				if o.Console != nil {
					io.WriteString(o.Console, line)
				}
			}
			if err != nil {
				return
			}
		}
	}()
	<-done
	waitErr := cmd.Wait()
	res.Total = time.Since(start)
	res.Console = console.String()

	tail := func() string { return lastLines(res.Console, 25) }
	if tctx.Err() == context.DeadlineExceeded {
		return res, fmt.Errorf("%w after %v; console tail:\n%s", ErrTimeout, o.Timeout, tail())
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	st, _ := os.ReadFile(status)
	finished := false
	for _, l := range strings.Split(string(st), "\n") {
		f := strings.Fields(strings.TrimSpace(l))
		switch {
		case len(f) == 3 && f[0] == "EXIT":
			if rc, err := strconv.Atoi(f[2]); err == nil {
				res.Exits[f[1]] = rc
			}
		case len(f) == 1 && f[0] == "DONE":
			finished = true
		}
	}
	if strings.Contains(res.Console, "Kernel panic") {
		return res, fmt.Errorf("%w; console tail:\n%s", ErrPanic, tail())
	}
	if !finished {
		return res, fmt.Errorf("%w (qemu: %v %s); console tail:\n%s", ErrNoStatus, waitErr, strings.TrimSpace(stderr.String()), tail())
	}
	return res, nil
}
