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
