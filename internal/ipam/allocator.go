package ipam

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"time"
)

var errNotImplemented = errors.New("not implemented")

// Config configures an Allocator.
type Config struct {
	// NodeName is this host's name in the cluster (the memberlist name).
	NodeName string
	// Store keeps the allocator's state (the state file's ipam table).
	Store Store
	// Logger receives the allocator's log lines; nil: slog.Default().
	Logger *slog.Logger
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// Allocator is one host's part of the cluster IPAM.
type Allocator struct{}

// New loads the allocator's state from cfg.Store; on the first start it
// creates and persists this host's identity.
func New(cfg Config) (*Allocator, error) { return nil, errNotImplemented }

// SetTransport connects the allocator to the cluster when the control plane
// starts (which may be after New). Until then the allocator allocates from
// the ranges it owns and refuses what needs another host.
func (a *Allocator) SetTransport(t Transport) {}

// Close stops the allocator's goroutines; requests in flight fail.
func (a *Allocator) Close() {}

// Capabilities returns what the plugin announces in GetCapabilities.
func (a *Allocator) Capabilities() Capabilities {
	return Capabilities{RequiresMACAddress: true}
}

// RequestPool validates r and returns the pool's ID; the first request of a
// pool in the cluster claims its ring. Errors are user-facing text.
func (a *Allocator) RequestPool(ctx context.Context, r PoolRequest) (PoolResponse, error) {
	return PoolResponse{}, errNotImplemented
}

// ReleasePool drops one use of the pool on this host.
func (a *Allocator) ReleasePool(ctx context.Context, poolID string) error {
	return errNotImplemented
}

// RequestAddress allocates an address of the pool (any, or r.Address) and
// returns it with the pool's prefix length; the allocation is on disk
// before it returns.
func (a *Allocator) RequestAddress(ctx context.Context, r AddressRequest) (netip.Prefix, error) {
	return netip.Prefix{}, errNotImplemented
}

// ReleaseAddress frees an address allocated on this host.
func (a *Allocator) ReleaseAddress(ctx context.Context, poolID, addr string) error {
	return errNotImplemented
}

// Reclaim makes this host the owner of every range owned by node's
// identities (node must be gone for good) and marks them reclaimed.
func (a *Allocator) Reclaim(ctx context.Context, node string) (ReclaimResult, error) {
	return ReclaimResult{}, errNotImplemented
}

// Status returns the allocator's state for `overlayd status`.
func (a *Allocator) Status() Status { return Status{} }

// HandleMessage takes a message of the allocator's protocol from the member
// named from. It never blocks: the message is queued for the allocator's
// goroutine (and dropped, counted, when the queue is full).
func (a *Allocator) HandleMessage(from string, payload []byte) {}

// MembersChanged tells the allocator the membership changed (a member
// joined, failed, left or returned). It never blocks.
func (a *Allocator) MembersChanged() {}
