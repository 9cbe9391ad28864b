package vm

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// guestPackages are built as static test binaries and run in the VM: the
// real-path suite (the encryption Owner with real ESP included), and the
// encryption package's own kernel tests, which on an ESP-capable kernel
// check the supported path.
//
// The driver's encrypted networks end to end run too, and the whole daemon
// under flushes (TestDaemonEncryptedFlushesVM in the guest package).
var guestPackages = []struct{ name, pkg, run string }{
	{"guest.test", "./test/vm/guest", ""},
	{"encryption.test", "./encryption", ""},
	{"driver.test", "./driver", "^TestEncryptedNetwork"},
	{"nlbatch.test", "./internal/nlbatch", "^TestXfrm"},
}

// mustPass are guest tests that must have passed (not skipped) in the VM.
var mustPass = []string{"TestDaemonEncryptedDualStackVM", "TestDaemonEncryptedFlushesVM", "TestEncryptedNetworkRealPath", "TestEncryptedOverlay", "TestOwnerFlushesVM", "TestOwnerGenerationsVM", "TestOwnerRepairsOnNotification", "TestOwnerRotation", "TestBatchRefusedRequestReported", "TestXfrmSendStates"}

func moduleRoot(t *testing.T) string {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil || strings.TrimSpace(string(out)) == "" {
		t.Fatalf("cannot find the module root: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// lineWriter forwards complete lines to fn.
type lineWriter struct {
	buf []byte
	fn  func(string)
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			return len(p), nil
		}
		w.fn(strings.TrimRight(string(w.buf[:i]), "\r"))
		w.buf = w.buf[i+1:]
	}
}

// TestVM boots Debian's kernel and runs the guest suites in it (see the
// package doc). It is part of `go test ./...`; it skips only when qemu or
// busybox are missing and cannot be installed (not root), or with -short.
func TestVM(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM; skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
	defer cancel()
	t0 := time.Now()
	if err := EnsureTools(ctx); err != nil {
		if errors.Is(err, ErrNoTools) && os.Geteuid() != 0 {
			t.Skipf("%v", err)
		}
		t.Fatal(err)
	}
	cache := DefaultCacheDir()
	k, err := FetchKernel(ctx, cache)
	if err != nil {
		t.Fatal(err)
	}
	tools := time.Since(t0)

	t1 := time.Now()
	root := moduleRoot(t)
	bin := t.TempDir()
	var bins []Binary
	packages := guestPackages
	bench := os.Getenv("OVERLAYD_VM_BENCH")
	if bench != "" {
		// Benchmarks only (see benchGuest).
		packages = nil
		b, err := benchGuest(ctx, root, bin, bench)
		if err != nil {
			t.Fatal(err)
		}
		bins = append(bins, b)
	}
	for _, g := range packages {
		out := filepath.Join(bin, g.name)
		cmd := exec.CommandContext(ctx, "go", "test", "-c", "-o", out, g.pkg)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("building %s: %v\n%s", g.pkg, err, b)
		}
		args := []string{"-test.v", "-test.count=1", "-test.timeout=4m"}
		if g.run != "" {
			args = append(args, "-test.run="+g.run)
		}
		bins = append(bins, Binary{Name: g.name, Path: out, Args: args})
	}
	build := time.Since(t1)

	var figures, failures []string
	verbose := testing.Verbose()
	var profile strings.Builder // base64 of a guest benchmark's CPU profile
	profiles := 0
	console := &lineWriter{fn: func(l string) {
		if i := strings.Index(l, "CPUPROFILE: "); i >= 0 {
			profile.WriteString(strings.TrimSpace(l[i+len("CPUPROFILE: "):]))
			return
		}
		if i := strings.Index(l, "CPUPROFILE-END: "); i >= 0 {
			profiles++
			path := filepath.Join(cache, fmt.Sprintf("guest-cpu-%d.prof", profiles))
			raw, err := base64.StdEncoding.DecodeString(profile.String())
			profile.Reset()
			if err == nil {
				err = os.WriteFile(path, raw, 0o644)
			}
			if err != nil {
				t.Errorf("guest CPU profile of %s: %v", strings.TrimSpace(l[i+len("CPUPROFILE-END: "):]), err)
			} else {
				t.Logf("guest CPU profile of %s: %s", strings.TrimSpace(l[i+len("CPUPROFILE-END: "):]), path)
			}
			return
		}
		if verbose {
			t.Log(l)
		}
		if strings.Contains(l, "FIGURE:") {
			figures = append(figures, strings.TrimSpace(l[strings.Index(l, "FIGURE:")+len("FIGURE:"):]))
		}
		if strings.HasPrefix(strings.TrimSpace(l), "--- FAIL") {
			failures = append(failures, strings.TrimSpace(l))
		}
	}}
	res, err := Run(ctx, Options{
		Kernel:          k,
		Modules:         GuestModules,
		OptionalModules: GuestOptionalModules,
		Binaries:        bins,
		Env:             map[string]string{"OVERLAYD_VM_GUEST": "1"},
		Timeout:         6 * time.Minute,
		Console:         console,
	})
	if res != nil {
		os.WriteFile(filepath.Join(cache, "last-console.log"), []byte(res.Console), 0o644)
	}
	if err != nil {
		t.Fatalf("%v\n(full console in %s)", err, filepath.Join(cache, "last-console.log"))
	}
	for _, f := range figures {
		t.Logf("figure: %s", f)
	}
	t.Logf("kernel %s (%s); tools+kernel %v, guest build %v; VM (%s): boot to first payload %v, boot+tests %v; initramfs %.1f MB",
		k.Release, k.Package, tools.Round(time.Millisecond), build.Round(time.Millisecond), res.Accel,
		res.Boot.Round(time.Millisecond), res.Total.Round(time.Millisecond), float64(res.Initramf)/1e6)
	if f := res.Failed(); len(f) != 0 {
		t.Fatalf("guest suites failed: %v\n%s\n(full console in %s)", f, strings.Join(failures, "\n"), filepath.Join(cache, "last-console.log"))
	}
	if bench != "" {
		if _, ok := res.Exits[bins[0].Name]; !ok {
			t.Fatalf("guest benchmark %s did not report", bins[0].Name)
		}
		return
	}
	for _, g := range guestPackages {
		if _, ok := res.Exits[g.name]; !ok {
			t.Fatalf("guest suite %s did not report", g.name)
		}
	}
	for _, name := range mustPass {
		if !strings.Contains(res.Console, "--- PASS: "+name+" ") {
			t.Fatalf("%s did not pass in the VM (skipped?)\n(full console in %s)", name, filepath.Join(cache, "last-console.log"))
		}
	}
}

// benchGuest is the encryption package's benchmarks matching the regexp
// bench, to run in the VM instead of the suites: `OVERLAYD_VM_BENCH=Owner
// go test -run TestVM -v ./test/vm` (OVERLAYD_VM_BENCHTIME: -test.benchtime,
// default 10x; OVERLAYD_VM_BENCHCOUNT: -test.count, default 1, for several
// rounds in one boot; OVERLAYD_VM_BENCH_PROFILE=1: a CPU profile of
// BenchmarkOwnerRemotes' measured loop per run, saved as guest-cpu-N.prof
// in the cache directory; OVERLAYD_VM_BENCH_BIN: a test binary built elsewhere,
// static, e.g. of an older commit, to compare).
func benchGuest(ctx context.Context, root, dir, bench string) (Binary, error) {
	benchtime := os.Getenv("OVERLAYD_VM_BENCHTIME")
	if benchtime == "" {
		benchtime = "10x"
	}
	count := os.Getenv("OVERLAYD_VM_BENCHCOUNT")
	if count == "" {
		count = "1"
	}
	b := Binary{Name: "encryption-bench.test", Path: os.Getenv("OVERLAYD_VM_BENCH_BIN"),
		Args: []string{"-test.run=^$", "-test.bench=" + bench, "-test.benchtime=" + benchtime, "-test.count=" + count}}
	if os.Getenv("OVERLAYD_VM_BENCH_PROFILE") == "1" {
		b.Args = append(b.Args, "-encryption.console-profile")
	}
	if b.Path != "" {
		return b, nil
	}
	b.Path = filepath.Join(dir, b.Name)
	cmd := exec.CommandContext(ctx, "go", "test", "-c", "-o", b.Path, "./encryption")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return Binary{}, fmt.Errorf("building the encryption benchmarks: %v\n%s", err, out)
	}
	return b, nil
}
