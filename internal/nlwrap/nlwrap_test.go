package nlwrap

import (
	"errors"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// A handle opened at a namespace dumps that namespace (a fresh one holds
// only lo), not the caller's.
func TestNewHandleAtDumpsItsNamespace(t *testing.T) {
	ns := nstest.NewNS(t, "nlwrap")
	h, err := NewHandleAt(ns.Handle, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	if len(links) != 1 || links[0].Attrs().Name != "lo" {
		t.Fatalf("links of a fresh namespace: %v, want lo only", links)
	}
}

// An interrupted dump is asked again; one interrupted DumpTries times in a
// row returns its error (never the partial result).
func TestRetry(t *testing.T) {
	calls := 0
	got, err := Retry(func() (int, error) {
		calls++
		if calls < 3 {
			return -1, netlink.ErrDumpInterrupted
		}
		return 7, nil
	})
	if got != 7 || err != nil || calls != 3 {
		t.Fatalf("Retry: %d %v after %d calls, want 7 after 3", got, err, calls)
	}
	calls = 0
	got, err = Retry(func() (int, error) { calls++; return -1, netlink.ErrDumpInterrupted })
	if !errors.Is(err, netlink.ErrDumpInterrupted) || got != 0 || calls != DumpTries {
		t.Fatalf("always interrupted: %d %v after %d calls, want the zero value and the error after %d", got, err, calls, DumpTries)
	}
	calls = 0
	other := errors.New("no such device")
	if _, err := Retry(func() (int, error) { calls++; return 0, other }); err != other || calls != 1 {
		t.Fatalf("another error: %v after %d calls, want it at once", err, calls)
	}
}
