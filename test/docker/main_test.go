package docker

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// runRoot holds everything one run of this test binary creates: the overlayd
// binary, the busybox image tarball and one directory per test (engines,
// their namespaces' mounts, overlayd's state). It is a shared bind mount of
// itself, so that mounts made and removed here in the host's mount namespace
// (overlayd's sandbox namespaces) propagate into the engines' mount
// namespaces, which are its slaves: an engine started while a sandbox exists
// must not keep a copy of its mount, or the sandbox namespace (and its VXLAN
// links) would outlive overlayd's removing it. A lock file held for the life
// of the process tells a later run whether the directory is stale.
var (
	runRoot   string
	runLock   *os.File
	suiteFrom time.Time
)

const runRootPattern = "ovdt-"

func TestMain(m *testing.M) {
	suiteFrom = time.Now()
	// Orphans of the engines (containerd shims, a containerd whose dockerd
	// was killed) are re-parented to this process rather than to PID 1, so
	// that the suite can reap them (see reapOrphans) and leaves no zombies.
	unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	code := func() int {
		if os.Geteuid() != 0 {
			// The tests skip themselves (with the reason) when they run.
			return m.Run()
		}
		sweepStaleRuns(os.TempDir())
		if err := makeRunRoot(); err != nil {
			fmt.Fprintf(os.Stderr, "test setup: %v\n", err)
			return 1
		}
		defer removeRunRoot()
		return m.Run()
	}()
	engine := ""
	if selected.name != "" {
		engine = " (engine " + selected.name + ")"
	}
	fmt.Printf("suite duration: %v%s\n", time.Since(suiteFrom).Round(10*time.Millisecond), engine)
	os.Exit(code)
}

func makeRunRoot() error {
	dir, err := os.MkdirTemp("", runRootPattern)
	if err != nil {
		return err
	}
	runRoot = dir
	runLock, err = os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	if err := unix.Flock(int(runLock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return fmt.Errorf("lock %s: %w", dir, err)
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mount %s on itself: %w", dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", dir, err)
	}
	return nil
}

func removeRunRoot() {
	if runRoot == "" {
		return
	}
	if err := removeTree(runRoot); err != nil {
		fmt.Fprintf(os.Stderr, "cleanup: %v\n", err)
	}
	runLock.Close()
}

// requireRoot skips t unless it runs as root.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("real-engine test: needs root (it installs packages, starts dockerd engines and makes namespaces)")
	}
	if runtime.GOOS != "linux" {
		t.Skip("real-engine test: Linux only")
	}
}

// Shared per-binary preparation: packages, the overlayd binary, the image.
var (
	prepOnce sync.Once
	prepErr  error
	selected engineKind // the engine OVERLAYD_TEST_ENGINE picks
	overlayd string     // path of the overlayd binary built for this run
	imageTar string     // path of the busybox image tarball (rootfs)
)

// prepare installs what the suite needs and builds overlayd and the image
// rootfs, once per test binary; it fails t if that failed.
func prepare(t testing.TB) {
	t.Helper()
	requireRoot(t)
	prepOnce.Do(func() {
		if selected, prepErr = selectedEngine(); prepErr != nil {
			return
		}
		if prepErr = ensureInstalled(); prepErr != nil {
			return
		}
		if installTook > time.Second {
			fmt.Printf("installed packages in %v\n", installTook.Round(100*time.Millisecond))
		}
		v, err := useEngine(selected)
		if prepErr = err; err != nil {
			return
		}
		// Which engine runs, in the output of every run (go test shows a
		// passing package's output in local-directory mode and with -v).
		fmt.Printf("real-engine suite: engine %s (%s): dockerd %s: %q; CLI %s: %q; containerd %q\n",
			selected.name, selected.about, dockerd, v.dockerd, dockerCLI, v.cli, v.containerd)
		start := time.Now()
		overlayd = filepath.Join(runRoot, "overlayd")
		if prepErr = buildOverlayd(overlayd, ""); prepErr != nil {
			return
		}
		fmt.Printf("built overlayd in %v\n", time.Since(start).Round(10*time.Millisecond))
		imageTar = filepath.Join(runRoot, "busybox.tar")
		prepErr = writeBusyboxRootfs(imageTar)
	})
	if prepErr != nil {
		t.Fatalf("suite preparation: %v", prepErr)
	}
}

// moduleRoot is the repository root (this package is test/docker).
func moduleRoot() string {
	wd, _ := os.Getwd()
	return filepath.Dir(filepath.Dir(wd))
}

// buildOverlayd builds a static overlayd as `make build` does; a stamp
// other than "" is the version it reports (as make's VERSION).
func buildOverlayd(out, stamp string) error {
	args := []string{"build", "-trimpath", "-o", out}
	if stamp != "" {
		args = append(args, "-ldflags", "-X github.com/overlayd/overlayd/internal/version.stamp="+stamp)
	}
	cmd := exec.Command("go", append(args, "./cmd/overlayd")...)
	cmd.Dir = moduleRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./cmd/overlayd: %v\n%s", err, b)
	}
	return nil
}
