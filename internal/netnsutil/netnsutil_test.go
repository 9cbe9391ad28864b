package netnsutil

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestNamedNamespaceLifecycle(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	dir := t.TempDir()
	if err := MakeSharedMount(dir); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	if !isMountPoint(dir) {
		t.Fatal("not a mount point after MakeSharedMount")
	}
	if err := MakeSharedMount(dir); err != nil { // idempotent
		t.Fatal(err)
	}
	path := filepath.Join(dir, "ns1")
	ns, err := NewNamed(path)
	if err != nil {
		t.Fatal(err)
	}
	ns.Close()
	if !IsNamespace(path) {
		t.Fatal("named namespace not mounted")
	}
	if _, err := NewNamed(path); err == nil {
		t.Fatal("NewNamed over an existing namespace succeeded")
	}
	if err := RemoveNamed(path); err != nil {
		t.Fatal(err)
	}
	if IsNamespace(path) {
		t.Fatal("namespace still mounted")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatal("mount point file left")
	}
	if err := RemoveNamed(path); err != nil {
		t.Fatalf("removing a missing namespace: %v", err)
	}
}

// TestSocketBelongsToNamespace checks that Socket opens the socket in the
// namespace given, not the caller's: the kernel names a socket's namespace
// (SIOCGSKNS).
func TestSocketBelongsToNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	ns, err := New()
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	fd, err := Socket(ns, unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	skns, err := unix.IoctlRetInt(fd, unix.SIOCGSKNS)
	if err != nil {
		t.Fatalf("SIOCGSKNS: %v", err)
	}
	defer unix.Close(skns)
	var got, want unix.Stat_t
	if err := unix.Fstat(skns, &got); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fstat(int(ns), &want); err != nil {
		t.Fatal(err)
	}
	if got.Ino != want.Ino || got.Dev != want.Dev {
		t.Fatalf("socket in namespace inode %d, want %d (the one given)", got.Ino, want.Ino)
	}
}
