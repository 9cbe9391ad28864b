package ipam

import (
	"context"
	"errors"
	"net/netip"
)

// Refusal reasons: a short fixed word per kind of refused request, for the
// metrics (overlayd_ipam_refused_total{reason}); the error's text is what
// the user reads.
const (
	ReasonBadInput          = "bad_input"          // a field dockerd sent is not acceptable
	ReasonPoolFull          = "pool_full"          // every address of the pool is in use
	ReasonNoSpaceReachable  = "no_space_reachable" // free space exists only on hosts that did not give any
	ReasonInUse             = "in_use"             // the address asked for is held (here or elsewhere)
	ReasonOwnerUnreachable  = "owner_unreachable"  // the owner of the address asked for cannot be asked
	ReasonNoMajority        = "no_majority"        // a new pool's ring could not be agreed
	ReasonNotJoined         = "not_joined"         // the cluster has not started or this host has not joined it
	ReasonIdentityReclaimed = "identity_reclaimed" // another host reclaimed this host's space
	ReasonStateFile         = "state_file"         // the state file could not be written
	ReasonShuttingDown      = "shutting_down"
)

// refusal is an error with the reason it was refused (RefusalReason).
type refusal struct {
	reason string
	err    error
}

func (r *refusal) Error() string         { return r.err.Error() }
func (r *refusal) Unwrap() error         { return r.err }
func (r *refusal) RefusalReason() string { return r.reason }

// refuse gives err a reason; an error that has one keeps it.
func refuse(reason string, err error) error {
	if err == nil {
		return nil
	}
	var r *refusal
	if errors.As(err, &r) {
		return err
	}
	return &refusal{reason: reason, err: err}
}

// ReasonOf returns the reason err was refused for, "" if none is known.
func ReasonOf(err error) string {
	var r *refusal
	if errors.As(err, &r) {
		return r.reason
	}
	return ""
}

// The calls dockerd makes: what the allocator refuses without another
// reason is a field it was sent (the messages name it).

// RequestPool validates r and returns the pool's ID. The first request of
// a pool in the cluster claims its ring (agreed by a majority of the
// cluster); a later one learns the ring from the hosts that know it. The
// use count is on disk before it returns. Errors are user-facing text.
func (a *Allocator) RequestPool(ctx context.Context, r PoolRequest) (PoolResponse, error) {
	resp, err := a.requestPool(ctx, r)
	return resp, refuse(ReasonBadInput, err)
}

// ReleasePool drops one use of the pool on this host. The pool's ring and
// this host's part of it stay: other hosts may still use the network.
func (a *Allocator) ReleasePool(ctx context.Context, poolID string) error {
	return refuse(ReasonBadInput, a.releasePool(ctx, poolID))
}

// RequestAddress allocates an address of the pool (any, or r.Address) and
// returns it with the pool's prefix length; the allocation is on disk
// before it returns. With the gateway option it returns the pool's gateway
// and allocates nothing.
func (a *Allocator) RequestAddress(ctx context.Context, r AddressRequest) (netip.Prefix, error) {
	p, err := a.requestAddress(ctx, r)
	return p, refuse(ReasonBadInput, err)
}

// ReleaseAddress frees an address allocated on this host; the release is
// on disk before it returns. Releasing the gateway does nothing (it is
// never allocated).
func (a *Allocator) ReleaseAddress(ctx context.Context, poolID, addr string) error {
	return refuse(ReasonBadInput, a.releaseAddress(ctx, poolID, addr))
}
