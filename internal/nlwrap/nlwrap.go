// Package nlwrap is overlayd's one way to a netlink handle: opened in a
// namespace through netnsutil (a thread that cannot switch back is never
// returned to the scheduler, where netlink.NewHandleAt ignores the
// failure), and with every dump retried when the kernel reports it was
// interrupted by a concurrent change (the partial result would be wrong;
// netlink returns it with ErrDumpInterrupted). test/lint refuses raw
// handles and raw dumps outside this package.
package nlwrap

import (
	"errors"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// DumpTries is how often an interrupted dump is asked again before its
// error is returned: an interruption needs a change between two parts of
// one dump, so a busy table rarely takes more than two.
const DumpTries = 10

// Handle is a netlink handle whose dumps are retried on interruption. Its
// other methods are netlink's. Safe for concurrent use as netlink's is.
// The raw handle is unexported: no caller reaches a dump past the retry.
type Handle struct {
	*rawHandle
}

type rawHandle = netlink.Handle

// Wrap makes h a Handle (for tests, whose namespaces' handles nstest
// opens); product code opens handles with NewHandleAt.
func Wrap(h *netlink.Handle) *Handle { return &Handle{rawHandle: h} }

// NewHandleAt opens a handle of the given netlink families (all when
// none) in ns.
func NewHandleAt(ns netns.NsHandle, families ...int) (*Handle, error) {
	var h *netlink.Handle
	err := netnsutil.DoIn(ns, func() error {
		var err error
		h, err = netlink.NewHandle(families...)
		return err
	})
	if err != nil {
		if h != nil {
			h.Close()
		}
		return nil, err
	}
	return &Handle{rawHandle: h}, nil
}

// Close releases the handle's sockets.
func (h *Handle) Close() {
	if h != nil && h.rawHandle != nil {
		h.rawHandle.Close()
	}
}

// Retry runs dump until it is not interrupted, at most DumpTries times.
func Retry[T any](dump func() (T, error)) (T, error) {
	var res T
	var err error
	for range DumpTries {
		res, err = dump()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return res, err
		}
	}
	var zero T
	return zero, err
}

func (h *Handle) LinkList() ([]netlink.Link, error) { return Retry(h.rawHandle.LinkList) }

func (h *Handle) AddrList(link netlink.Link, family int) ([]netlink.Addr, error) {
	return Retry(func() ([]netlink.Addr, error) { return h.rawHandle.AddrList(link, family) })
}

func (h *Handle) NeighList(index, family int) ([]netlink.Neigh, error) {
	return Retry(func() ([]netlink.Neigh, error) { return h.rawHandle.NeighList(index, family) })
}

func (h *Handle) RouteList(link netlink.Link, family int) ([]netlink.Route, error) {
	return Retry(func() ([]netlink.Route, error) { return h.rawHandle.RouteList(link, family) })
}

func (h *Handle) RouteListFiltered(family int, filter *netlink.Route, mask uint64) ([]netlink.Route, error) {
	return Retry(func() ([]netlink.Route, error) { return h.rawHandle.RouteListFiltered(family, filter, mask) })
}

func (h *Handle) XfrmStateList(family int) ([]netlink.XfrmState, error) {
	return Retry(func() ([]netlink.XfrmState, error) { return h.rawHandle.XfrmStateList(family) })
}

func (h *Handle) XfrmPolicyList(family int) ([]netlink.XfrmPolicy, error) {
	return Retry(func() ([]netlink.XfrmPolicy, error) { return h.rawHandle.XfrmPolicyList(family) })
}
