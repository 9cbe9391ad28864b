// Package netnsutil creates, opens and removes network namespaces without ever
// leaving a goroutine's OS thread in a foreign namespace.
//
// Every function that has to switch a thread's namespace does so on a thread
// locked to its goroutine, and switches back before unlocking it. If switching
// back fails the thread is left locked, so the Go runtime terminates it when the
// goroutine exits instead of handing a thread in the wrong namespace to other
// goroutines.
package netnsutil

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// New creates an anonymous network namespace and returns a handle to it. The
// namespace lives as long as a handle (or a mount, or a process) refers to it.
func New() (netns.NsHandle, error) {
	var ns netns.NsHandle
	ns = netns.None()
	err := Do(func(orig netns.NsHandle) error {
		var err error
		ns, err = netns.New() // unshare + open; switches this (locked) thread
		return err
	})
	if err != nil {
		if ns.IsOpen() {
			ns.Close() // made, but the thread could not switch back
		}
		return netns.None(), fmt.Errorf("failed to create network namespace: %w", err)
	}
	return ns, nil
}

// NewNamed creates a network namespace, bind-mounts it at path so that it
// outlives this process, and returns a handle to it. The parent directory is
// created if needed. On failure nothing is left behind.
func NewNamed(path string) (netns.NsHandle, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return netns.None(), fmt.Errorf("failed to create namespace directory for %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return netns.None(), fmt.Errorf("failed to create namespace mount point %s: %w", path, err)
	}
	f.Close()

	ns, err := New()
	if err != nil {
		os.Remove(path)
		return netns.None(), err
	}
	src := fmt.Sprintf("/proc/self/fd/%d", int(ns))
	if err := unix.Mount(src, path, "none", unix.MS_BIND, ""); err != nil {
		ns.Close()
		os.Remove(path)
		return netns.None(), fmt.Errorf("failed to bind-mount network namespace at %s: %w", path, err)
	}
	return ns, nil
}

// Open returns a handle to the namespace mounted at path.
func Open(path string) (netns.NsHandle, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return netns.None(), fmt.Errorf("failed to open network namespace %s: %w", path, err)
	}
	return ns, nil
}

// RemoveNamed unmounts and removes the namespace mount at path. A path that
// does not exist is not an error. The namespace itself disappears once no
// handle, mount or process refers to it any more.
func RemoveNamed(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil &&
		!errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("failed to unmount network namespace %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("failed to remove network namespace mount point %s: %w", path, err)
	}
	return nil
}

// IsNamespace reports whether path is a mounted network namespace.
func IsNamespace(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return st.Type == unix.NSFS_MAGIC
}

// Do runs fn on a locked OS thread and restores that thread's original network
// namespace afterwards; fn receives a handle to the original namespace. fn may
// switch the thread's namespace (that is its purpose) but must not start
// goroutines that expect to inherit it.
func Do(fn func(orig netns.NsHandle) error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("failed to get current network namespace: %w", err)
			return
		}
		defer orig.Close()
		ferr := fn(orig)
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: it dies with this goroutine.
			errc <- errors.Join(ferr, fmt.Errorf("failed to restore network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// DoIn runs fn on a locked OS thread switched into ns, then restores it.
func DoIn(ns netns.NsHandle, fn func() error) error {
	return Do(func(netns.NsHandle) error {
		if err := netns.Set(ns); err != nil {
			return fmt.Errorf("failed to enter network namespace: %w", err)
		}
		return fn()
	})
}

// Socket opens a socket (see socket(2)) in ns: sockets of most families
// (netlink, packet, raw IP) belong for good to the namespace of the thread
// that created them, whichever thread uses them afterwards.
func Socket(ns netns.NsHandle, domain, typ, proto int) (int, error) {
	fd := -1
	err := DoIn(ns, func() error {
		var err error
		fd, err = unix.Socket(domain, typ, proto)
		return err
	})
	if err != nil && fd >= 0 {
		unix.Close(fd)
		fd = -1
	}
	return fd, err
}

// BindToKernel binds the netlink socket fd to a port of its own and
// connects it to the kernel, so that it refuses unicasts from other ports
// (another process cannot inject replies), and returns the port: the
// sender of the socket's requests, which the kernel's replies carry.
func BindToKernel(fd int) (port uint32, err error) {
	kernel := &unix.SockaddrNetlink{Family: unix.AF_NETLINK}
	if err := unix.Bind(fd, kernel); err != nil {
		return 0, fmt.Errorf("bind: %w", err)
	}
	if err := unix.Connect(fd, kernel); err != nil {
		return 0, fmt.Errorf("connect: %w", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return 0, fmt.Errorf("getsockname: %w", err)
	}
	nsa, ok := sa.(*unix.SockaddrNetlink)
	if !ok {
		return 0, fmt.Errorf("getsockname: unexpected address %T", sa)
	}
	return nsa.Pid, nil
}

// MakeSharedMount makes dir a mount point with shared propagation, binding it
// onto itself first if it is not one (as iproute2 does for /run/netns). Mount
// namespaces created later (other engines, services with private mounts)
// then receive the unmount of a sandbox instead of keeping a copy that pins
// the namespace and its VXLAN VNIs.
func MakeSharedMount(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("failed to create %s: %w", dir, err)
	}
	err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, "")
	if err == nil {
		if isMountPoint(dir) {
			return nil
		}
		// The parent's mount became shared; dir itself still needs its own.
	} else if !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("failed to make %s a shared mount: %w", dir, err)
	}
	if err := unix.Mount(dir, dir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("failed to bind %s onto itself: %w", dir, err)
	}
	if err := unix.Mount("", dir, "none", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("failed to make %s a shared mount: %w", dir, err)
	}
	return nil
}

// isMountPoint reports whether dir is the root of a mount (its device
// differs from its parent's, or /proc/self/mountinfo lists it).
func isMountPoint(dir string) bool {
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	clean := filepath.Clean(dir)
	for _, line := range bytesLines(raw) {
		f := splitFields(line)
		if len(f) > 4 && unescapeMount(f[4]) == clean {
			return true
		}
	}
	return false
}

func bytesLines(b []byte) []string {
	var out []string
	start := 0
	for i, c := range b {
		if c == '\n' {
			out = append(out, string(b[start:i]))
			start = i + 1
		}
	}
	return out
}

func splitFields(s string) []string {
	var out []string
	field := ""
	for _, c := range s {
		if c == ' ' {
			if field != "" {
				out = append(out, field)
			}
			field = ""
			continue
		}
		field += string(c)
	}
	if field != "" {
		out = append(out, field)
	}
	return out
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space...).
func unescapeMount(s string) string {
	out := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			v := (s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0')
			out = append(out, v)
			i += 3
			continue
		}
		out = append(out, s[i])
	}
	return string(out)
}
