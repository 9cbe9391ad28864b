package docker

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Process and mount clean-up. Everything here acts only on what this suite
// made: processes are chosen by the directory of the run, test or engine
// that appears on their command line (every dockerd, containerd and shim the
// suite starts names its own paths), by the inode of an engine's network
// namespace, or by being a zombie child of this process; mounts by their
// mount point lying under such a directory.

// procInfo is what we read of a process.
type procInfo struct {
	pid     int
	ppid    int
	state   byte
	comm    string
	cmdline string
	netns   string // "net:[inode]"
}

func listProcs() []procInfo {
	ents, _ := os.ReadDir("/proc")
	var ps []procInfo
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		p := procInfo{pid: pid}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...; comm may contain spaces and parentheses.
		s := string(stat)
		open, closing := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if open < 0 || closing < open || closing+4 > len(s) {
			continue
		}
		p.comm = s[open+1 : closing]
		f := strings.Fields(s[closing+1:])
		if len(f) < 2 {
			continue
		}
		p.state = f[0][0]
		p.ppid, _ = strconv.Atoi(f[1])
		cl, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		p.cmdline = strings.ReplaceAll(string(cl), "\x00", " ")
		p.netns, _ = os.Readlink(fmt.Sprintf("/proc/%d/ns/net", pid))
		ps = append(ps, p)
	}
	return ps
}

// killProcs SIGKILLs every process (other than this one) that match selects,
// waits up to timeout for them to be gone and reaps those that are this
// process's children. It returns the ones still there.
func killProcs(match func(procInfo) bool, timeout time.Duration) []procInfo {
	self := os.Getpid()
	deadline := time.Now().Add(timeout)
	for {
		var left []procInfo
		for _, p := range listProcs() {
			if p.pid == self || !match(p) {
				continue
			}
			if p.state == 'Z' {
				if p.ppid == self {
					var ws unix.WaitStatus
					unix.Wait4(p.pid, &ws, unix.WNOHANG, nil)
					continue
				}
				// Someone else's zombie: nothing to kill, its parent reaps it.
				continue
			}
			unix.Kill(p.pid, syscall.SIGKILL)
			left = append(left, p)
		}
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// reapOrphans reaps zombies that were adopted by this process (it is a child
// subreaper, see TestMain): containerd shims and the like whose parent died.
// With all unset it reaps only those that cannot be the suite's own exec.Cmd
// children (containerd's, runc's), so that a Wait in flight is not robbed;
// with all set (at the end of a test, when no command runs) every zombie
// child, including container processes orphaned by a killed shim.
func reapOrphans(all bool) {
	self := os.Getpid()
	for _, p := range listProcs() {
		if p.ppid != self || p.state != 'Z' {
			continue
		}
		if all || strings.HasPrefix(p.comm, "containerd") || strings.HasPrefix(p.comm, "runc") {
			var ws unix.WaitStatus
			unix.Wait4(p.pid, &ws, unix.WNOHANG, nil)
		}
	}
}

// mountsUnder returns the mount points at or below dir in this process's
// mount namespace, deepest first.
func mountsUnder(dir string) []string {
	return mountsUnderIn("/proc/self/mountinfo", dir)
}

func mountsUnderIn(mountinfo, dir string) []string {
	f, err := os.Open(mountinfo)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for space…).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// unmountUnder detaches every mount at or below dir.
func unmountUnder(dir string) error {
	var errs []error
	for i := 0; i < 5; i++ {
		mps := mountsUnder(dir)
		if len(mps) == 0 {
			return nil
		}
		errs = errs[:0]
		for _, mp := range mps {
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("unmount %s: %w", mp, err))
			}
		}
	}
	if mps := mountsUnder(dir); len(mps) > 0 {
		return errors.Join(append(errs, fmt.Errorf("still mounted: %v", mps))...)
	}
	return nil
}

// removeTree kills what still refers to dir, unmounts everything below it and
// removes it.
func removeTree(dir string) error {
	left := killProcs(func(p procInfo) bool { return strings.Contains(p.cmdline, dir+"/") }, 10*time.Second)
	var errs []error
	if len(left) > 0 {
		errs = append(errs, fmt.Errorf("processes still running: %v", left))
	}
	if err := unmountUnder(dir); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// sweepStaleRuns cleans up after earlier runs of this binary that died
// without cleaning up (killed, or timed out: a timeout panic runs no
// t.Cleanup). A run directory is stale when nobody holds its lock. Engines
// record their network namespace and cgroup parent in their directory, so
// that processes without our paths on their command line (a managed plugin,
// containers) are found too.
func sweepStaleRuns(tmp string) {
	dirs, _ := filepath.Glob(filepath.Join(tmp, runRootPattern+"*"))
	for _, dir := range dirs {
		lf, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_RDWR, 0)
		if err != nil {
			continue
		}
		if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			lf.Close()
			continue // in use by a running test binary
		}
		fmt.Printf("cleaning up stale test run %s\n", dir)
		marks, _ := filepath.Glob(filepath.Join(dir, "*", "*", "engine.ids"))
		for _, m := range marks {
			b, _ := os.ReadFile(m)
			var netnsID, cgParent string
			fmt.Sscan(string(b), &netnsID, &cgParent)
			if netnsID != "" {
				killProcs(func(p procInfo) bool { return p.netns == netnsID }, 5*time.Second)
			}
			if cgParent != "" {
				killCgroup(cgParent)
				removeCgroup(cgParent)
			}
		}
		if err := removeTree(dir); err != nil {
			fmt.Printf("stale test run %s: %v\n", dir, err)
		}
		lf.Close()
	}
}

// cgroupDirs returns the directories of cgroup parent name in every mounted
// hierarchy.
func cgroupDirs(name string) []string {
	var out []string
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	roots = append(roots, "/sys/fs/cgroup")
	for _, r := range roots {
		d := filepath.Join(r, name)
		if st, err := os.Stat(d); err == nil && st.IsDir() {
			out = append(out, d)
		}
	}
	return out
}

// killCgroup kills every process in the cgroups below parent name.
func killCgroup(name string) {
	for _, d := range cgroupDirs(name) {
		filepath.WalkDir(d, func(path string, e os.DirEntry, err error) error {
			if err != nil || e.IsDir() || e.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(path)
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && pid != os.Getpid() {
					unix.Kill(pid, syscall.SIGKILL)
				}
			}
			return nil
		})
	}
}

// removeCgroup removes the (empty) cgroup directories below and of parent
// name, deepest first.
func removeCgroup(name string) error {
	var errs []error
	for _, d := range cgroupDirs(name) {
		var dirs []string
		filepath.WalkDir(d, func(path string, e os.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				dirs = append(dirs, path)
			}
			return nil
		})
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, x := range dirs {
			var err error
			for i := 0; i < 20; i++ { // a cgroup is busy for a moment after its last process exits
				if err = unix.Rmdir(x); err == nil || errors.Is(err, unix.ENOENT) {
					err = nil
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("rmdir %s: %w", x, err))
			}
		}
	}
	return errors.Join(errs...)
}
