package vm

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// MetaPackage is the Debian package whose dependency names the current
// cloud kernel (small, modules as plain .ko files).
const MetaPackage = "linux-image-cloud-amd64"

// ErrNoTools means qemu or a static busybox is missing and cannot be
// installed (not root).
var ErrNoTools = errors.New("vm: qemu-system-x86_64 or a static busybox is missing")

// Kernel is a Debian kernel package extracted into the cache: its vmlinuz
// and its module tree.
type Kernel struct {
	Package string // e.g. linux-image-6.1.0-57-cloud-amd64
	Release string // e.g. 6.1.0-57-cloud-amd64 (uname -r)
	Vmlinuz string
	ModDir  string // lib/modules/<release>
}

// DefaultCacheDir is $OVERLAYD_VM_CACHE, or overlayd-vm in the user's cache
// directory (/root/.cache/overlayd-vm for root).
func DefaultCacheDir() string {
	if d := os.Getenv("OVERLAYD_VM_CACHE"); d != "" {
		return d
	}
	if d, err := os.UserCacheDir(); err == nil {
		return filepath.Join(d, "overlayd-vm")
	}
	return filepath.Join(os.TempDir(), "overlayd-vm")
}

func run(ctx context.Context, dir string, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	if err != nil {
		return out.Bytes(), fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, lastLines(out.String(), 10))
	}
	return out.Bytes(), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// BusyboxPath is where busybox-static installs busybox.
const BusyboxPath = "/bin/busybox"

func haveTools() bool {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		return false
	}
	return isStatic(BusyboxPath)
}

// isStatic reports whether the ELF file has no program interpreter.
func isStatic(path string) bool {
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

// EnsureTools makes sure qemu-system-x86_64 and a static busybox exist,
// installing qemu-system-x86 and busybox-static with apt-get when they do
// not and we are root. It returns ErrNoTools when they are missing and
// cannot be installed.
func EnsureTools(ctx context.Context) error {
	if haveTools() {
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w (install qemu-system-x86 and busybox-static, or run as root to let the test install them)", ErrNoTools)
	}
	// The real-engine suite may be installing at the same time: wait for
	// dpkg's lock rather than fail.
	install := []string{"-o", "DPkg::Lock::Timeout=300", "install", "-y", "-q", "--no-install-recommends", "qemu-system-x86", "busybox-static"}
	if _, err := run(ctx, "", "apt-get", install...); err != nil {
		if _, uerr := run(ctx, "", "apt-get", "-o", "DPkg::Lock::Timeout=300", "update", "-q"); uerr != nil {
			return fmt.Errorf("%w: apt-get update: %v", ErrNoTools, uerr)
		}
		if _, err := run(ctx, "", "apt-get", install...); err != nil {
			return fmt.Errorf("%w: %v", ErrNoTools, err)
		}
	}
	if !haveTools() {
		return fmt.Errorf("%w after installing qemu-system-x86 and busybox-static", ErrNoTools)
	}
	return nil
}

// kernelPackage asks apt which package the meta package depends on.
func kernelPackage(ctx context.Context) (string, error) {
	out, err := run(ctx, "", "apt-cache", "depends", MetaPackage)
	if err == nil {
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") {
				return f[1], nil
			}
		}
		err = fmt.Errorf("apt-cache depends %s names no kernel image", MetaPackage)
	}
	return "", err
}

// FetchKernel returns Debian's cloud kernel, extracted under cacheDir. The
// package is fetched with `apt-get download` and unpacked with `dpkg-deb
// -x` (never installed on the host) once per kernel version; later calls
// reuse it. If apt cannot tell or fetch the current version, the newest
// kernel already in the cache is used.
func FetchKernel(ctx context.Context, cacheDir string) (*Kernel, error) {
	kdir := filepath.Join(cacheDir, "kernels")
	if err := os.MkdirAll(kdir, 0o755); err != nil {
		return nil, err
	}
	pkg, err := kernelPackage(ctx)
	if err != nil && os.Geteuid() == 0 {
		if _, uerr := run(ctx, "", "apt-get", "-o", "DPkg::Lock::Timeout=300", "update", "-q"); uerr == nil {
			pkg, err = kernelPackage(ctx)
		}
	}
	if err != nil {
		if k := newestCached(kdir); k != nil {
			return k, nil
		}
		return nil, fmt.Errorf("vm: cannot find Debian's kernel package: %w", err)
	}
	dir := filepath.Join(kdir, pkg)
	if k, err := loadKernel(pkg, dir); err == nil {
		return k, nil
	}
	tmp, err := os.MkdirTemp(kdir, ".fetch-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	if _, err := run(ctx, tmp, "apt-get", "download", "-q", pkg); err != nil {
		if k := newestCached(kdir); k != nil {
			return k, nil
		}
		return nil, fmt.Errorf("vm: %w", err)
	}
	debs, _ := filepath.Glob(filepath.Join(tmp, "*.deb"))
	if len(debs) != 1 {
		return nil, fmt.Errorf("vm: apt-get download %s left %d .deb files", pkg, len(debs))
	}
	x := filepath.Join(tmp, "x")
	if _, err := run(ctx, tmp, "dpkg-deb", "-x", debs[0], x); err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	os.RemoveAll(dir)
	if err := os.Rename(x, dir); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, ".complete"), []byte(pkg+"\n"), 0o644); err != nil {
		return nil, err
	}
	// Older kernels (about 100 MB each) are not needed any more.
	if entries, err := os.ReadDir(kdir); err == nil {
		for _, e := range entries {
			if e.IsDir() && e.Name() != pkg && strings.HasPrefix(e.Name(), "linux-image-") {
				os.RemoveAll(filepath.Join(kdir, e.Name()))
			}
		}
	}
	return loadKernel(pkg, dir)
}

func loadKernel(pkg, dir string) (*Kernel, error) {
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err != nil {
		return nil, err
	}
	vmlinuz, _ := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*"))
	mods, _ := filepath.Glob(filepath.Join(dir, "lib", "modules", "*"))
	if len(vmlinuz) != 1 || len(mods) != 1 {
		return nil, fmt.Errorf("vm: %s does not hold one vmlinuz and one module tree", dir)
	}
	return &Kernel{Package: pkg, Release: filepath.Base(mods[0]), Vmlinuz: vmlinuz[0], ModDir: mods[0]}, nil
}

func newestCached(kdir string) *Kernel {
	entries, _ := os.ReadDir(kdir)
	var best *Kernel
	var bestTime int64
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		k, err := loadKernel(e.Name(), filepath.Join(kdir, e.Name()))
		if err != nil {
			continue
		}
		if st, err := os.Stat(k.Vmlinuz); err == nil && st.ModTime().UnixNano() > bestTime {
			best, bestTime = k, st.ModTime().UnixNano()
		}
	}
	return best
}

// modName normalises a module name: the kernel treats - and _ alike.
func modName(s string) string {
	s = filepath.Base(s)
	s = strings.TrimSuffix(s, ".ko")
	return strings.ReplaceAll(s, "-", "_")
}

// ResolveModules returns, in load order (dependencies first), the module
// files needed for the named modules. Dependencies come from each module's
// .modinfo "depends=" (what depmod writes into modules.dep, which the
// package does not ship) and "softdep=pre:" entries. Built-in modules
// (modules.builtin) are skipped. A required module that is neither a file
// nor built in is an error; optional ones are skipped.
func (k *Kernel) ResolveModules(required, optional []string) (order []string, err error) {
	files := map[string]string{}
	err = filepath.WalkDir(filepath.Join(k.ModDir, "kernel"), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if strings.HasSuffix(p, ".ko") {
			files[modName(p)] = p
		} else if strings.Contains(filepath.Base(p), ".ko.") {
			files[modName(strings.SplitN(filepath.Base(p), ".ko.", 2)[0])] = "compressed:" + p
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(k.ModDir, "modules.builtin")); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if l != "" {
				builtin[modName(l)] = true
			}
		}
	}
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string, req bool, chain []string) error
	visit = func(name string, req bool, chain []string) error {
		name = modName(name)
		if builtin[name] || state[name] == 2 {
			return nil
		}
		if state[name] == 1 {
			return fmt.Errorf("module dependency cycle: %s", strings.Join(append(chain, name), " -> "))
		}
		p, ok := files[name]
		if !ok {
			if req {
				return fmt.Errorf("module %s is neither in %s nor built in", name, k.ModDir)
			}
			return nil
		}
		if strings.HasPrefix(p, "compressed:") {
			return fmt.Errorf("module %s is compressed; only plain .ko modules are supported", strings.TrimPrefix(p, "compressed:"))
		}
		state[name] = 1
		deps, soft, err := modinfoDeps(p)
		if err != nil {
			return fmt.Errorf("module %s: %w", p, err)
		}
		for _, s := range soft {
			if err := visit(s, false, append(chain, name)); err != nil {
				return err
			}
		}
		for _, d := range deps {
			if err := visit(d, true, append(chain, name)); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, p)
		return nil
	}
	// Callers' order is kept: some modules need others loaded first without
	// naming them in depends= (jitterentropy_rng asks for sha3 by name).
	for _, m := range required {
		if err := visit(m, true, nil); err != nil {
			return nil, err
		}
	}
	for _, m := range optional {
		if err := visit(m, false, nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// modinfoDeps reads depends= and softdep=pre: from a module's .modinfo.
func modinfoDeps(path string) (deps, softPre []string, err error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, nil, errors.New("no .modinfo section")
	}
	data, err := sec.Data()
	if err != nil {
		return nil, nil, err
	}
	for _, kv := range bytes.Split(data, []byte{0}) {
		s := string(kv)
		switch {
		case strings.HasPrefix(s, "depends="):
			for _, d := range strings.Split(strings.TrimPrefix(s, "depends="), ",") {
				if d != "" {
					deps = append(deps, d)
				}
			}
		case strings.HasPrefix(s, "softdep="):
			// "pre: a b post: c"
			fields := strings.Fields(strings.TrimPrefix(s, "softdep="))
			pre := false
			for _, fld := range fields {
				switch fld {
				case "pre:":
					pre = true
				case "post:":
					pre = false
				default:
					if pre {
						softPre = append(softPre, fld)
					}
				}
			}
		}
	}
	return deps, softPre, nil
}
