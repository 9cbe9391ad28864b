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
	err := Do(func(orig netns.NsHandle) error {
		var err error
		ns, err = netns.New() // unshare + open; switches this (locked) thread
		return err
	})
	if err != nil {
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
