package ipam

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"time"
)

// maxObtainRounds bounds how often one request asks other hosts for space
// when some did not answer.
const maxObtainRounds = 3

// knownPoolOptions are RequestPool options the allocator accepts (and
// ignores): dockerd passes the driver's options through.
func checkAddressSpace(s string) error {
	if s != AddressSpace && s != "" {
		return fmt.Errorf("AddressSpace %q is not overlayd's (it serves %q only)", s, AddressSpace)
	}
	return nil
}

// requestPool is RequestPool; what it refuses without a reason of its own is bad input.
func (a *Allocator) requestPool(ctx context.Context, r PoolRequest) (PoolResponse, error) {
	if err := a.refuseIfReclaimed(); err != nil {
		return PoolResponse{}, err
	}
	if err := checkAddressSpace(r.AddressSpace); err != nil {
		return PoolResponse{}, err
	}
	if r.V6 {
		return PoolResponse{}, errors.New("V6: overlayd's address management serves IPv4 pools only (IPv6 pools: use the default IPAM driver, or a later overlayd)")
	}
	if r.Pool == "" {
		return PoolResponse{}, errors.New("Pool: --subnet is required with --ipam-driver overlayd: every host must name the same subnet")
	}
	prefix, err := netip.ParsePrefix(r.Pool)
	if err != nil {
		return PoolResponse{}, fmt.Errorf("Pool %q is not a subnet in CIDR form (e.g. 198.51.100.0/24)", r.Pool)
	}
	rng := prefix
	if r.SubPool != "" {
		if rng, err = netip.ParsePrefix(r.SubPool); err != nil {
			return PoolResponse{}, fmt.Errorf("SubPool (--ip-range) %q is not a range in CIDR form (e.g. 198.51.100.128/25)", r.SubPool)
		}
	}
	spec, err := newPoolSpec(prefix, rng, "Pool (--subnet)", "SubPool (--ip-range)")
	if err != nil {
		return PoolResponse{}, err
	}
	if err := a.checkOverlap(spec); err != nil {
		return PoolResponse{}, err
	}
	p := a.poolFor(spec)
	if p == nil {
		return PoolResponse{}, fmt.Errorf("this host already knows %d pools, the most it keeps", maxPools)
	}
	if err := a.ensureRing(ctx, p); err != nil {
		return PoolResponse{}, err
	}
	p.mu.Lock()
	p.refs++
	seq := a.journal.mark1(prefixPool+p.id, encodePoolRecord(p.refs, p.ring))
	p.mu.Unlock()
	if err := a.journal.wait(seq); err != nil {
		p.mu.Lock()
		p.refs--
		a.journal.mark1(prefixPool+p.id, encodePoolRecord(p.refs, p.ring))
		p.mu.Unlock()
		return PoolResponse{}, refuse(ReasonStateFile, fmt.Errorf("failed to record pool %s in the state file: %w", p.id, err))
	}
	a.broadcastPools([]*pool{p})
	return PoolResponse{PoolID: p.id, Pool: spec.prefix, Gateway: spec.gateway()}, nil
}

// checkOverlap refuses a pool that shares addresses with another pool in
// use: on this host, or on another as it last reported.
func (a *Allocator) checkOverlap(spec poolSpec) error {
	id := spec.id()
	for _, p := range a.allPools() {
		if p.id == id || !p.spec.overlaps(spec) {
			continue
		}
		p.mu.Lock()
		here := p.refs > 0
		var users []string
		for who, r := range p.reports {
			if r.stats.inUse {
				users = append(users, who.Name)
			}
		}
		p.mu.Unlock()
		sort.Strings(users)
		switch {
		case here:
			return fmt.Errorf("Pool %s overlaps pool %s, which a network of this host uses: overlayd pools may not share addresses", spec.prefix, p.id)
		case len(users) > 0:
			return fmt.Errorf("Pool %s overlaps pool %s, which networks on %s use: overlayd pools may not share addresses", spec.prefix, p.id, strings.Join(users, ", "))
		}
	}
	return nil
}

// releasePool is ReleasePool; what it refuses without a reason of its own is bad input.
func (a *Allocator) releasePool(ctx context.Context, poolID string) error {
	spec, err := parsePoolID(poolID)
	if err != nil {
		return err
	}
	p := a.lookupPool(spec.id())
	if p == nil {
		return fmt.Errorf("PoolID %s is not in use on this host", poolID)
	}
	p.mu.Lock()
	if p.refs == 0 {
		p.mu.Unlock()
		return fmt.Errorf("PoolID %s is not in use on this host", poolID)
	}
	p.refs--
	seq := a.journal.mark1(prefixPool+p.id, encodePoolRecord(p.refs, p.ring))
	p.mu.Unlock()
	if err := a.journal.wait(seq); err != nil {
		return refuse(ReasonStateFile, fmt.Errorf("failed to record the release of pool %s in the state file: %w", poolID, err))
	}
	a.broadcastPools([]*pool{p})
	return nil
}

// requestedPool finds the pool of a PoolID that RequestPool handed out on
// this host, with its ring known.
func (a *Allocator) requestedPool(poolID string) (*pool, error) {
	spec, err := parsePoolID(poolID)
	if err != nil {
		return nil, err
	}
	p := a.lookupPool(spec.id())
	if p != nil {
		p.mu.Lock()
		ok := p.ring != nil && p.refs > 0
		p.mu.Unlock()
		if ok {
			return p, nil
		}
	}
	return nil, fmt.Errorf("PoolID %s was not requested on this host (RequestPool first)", poolID)
}

// requestAddress is RequestAddress; what it refuses without a reason of its own is bad input.
func (a *Allocator) requestAddress(ctx context.Context, r AddressRequest) (netip.Prefix, error) {
	if err := a.refuseIfReclaimed(); err != nil {
		return netip.Prefix{}, err
	}
	p, err := a.requestedPool(r.PoolID)
	if err != nil {
		return netip.Prefix{}, err
	}
	s := p.spec
	var want netip.Addr
	if r.Address != "" {
		if want, err = netip.ParseAddr(r.Address); err != nil || !want.Is4() {
			return netip.Prefix{}, fmt.Errorf("Address %q is not an IPv4 address", r.Address)
		}
	}
	var mac [6]byte
	hasMAC := false
	for k, v := range r.Options {
		switch k {
		case OptionRequestAddressType:
			if v != RequestAddressTypeGateway {
				return netip.Prefix{}, fmt.Errorf("option %s=%q is not known (only %s)", k, v, RequestAddressTypeGateway)
			}
		case OptionMACAddress:
			if v == "" {
				continue
			}
			if mac, err = parseMAC(v); err != nil {
				return netip.Prefix{}, fmt.Errorf("option %s: %w", k, err)
			}
			hasMAC = true
		}
	}
	if r.Options[OptionRequestAddressType] == RequestAddressTypeGateway {
		if want.IsValid() && want != s.gatewayAddr() {
			return netip.Prefix{}, fmt.Errorf("Address %s: the gateway of an overlayd pool is always the subnet's first address, %s (the same on every host); leave --gateway out or give %s", want, s.gatewayAddr(), s.gatewayAddr())
		}
		return s.gateway(), nil
	}
	if want.IsValid() {
		x := u32(want)
		switch {
		case !s.prefix.Contains(want):
			return netip.Prefix{}, fmt.Errorf("Address %s is outside the pool's subnet %s", want, s.prefix)
		case x == s.network():
			return netip.Prefix{}, fmt.Errorf("Address %s is the subnet's network address", want)
		case x == s.broadcast():
			return netip.Prefix{}, fmt.Errorf("Address %s is the subnet's broadcast address", want)
		case want == s.gatewayAddr():
			return netip.Prefix{}, fmt.Errorf("Address %s is the pool's gateway, never a container's", want)
		case x < s.lo || x > s.hi:
			return netip.Prefix{}, fmt.Errorf("Address %s is outside the pool's range %s (--ip-range)", want, s.rng)
		}
	}
	d, hasDeadline := ctx.Deadline()
	ctx, cancel := context.WithDeadline(ctx, a.deadlineOf(d, hasDeadline))
	defer cancel()
	req := allocRequest{mac: mac, hasMAC: hasMAC}
	if want.IsValid() {
		x := u32(want)
		req.addr = &x
	}
	x, err := a.allocate(ctx, p, req)
	if err != nil {
		return netip.Prefix{}, err
	}
	return s.withBits(x), nil
}

type allocRequest struct {
	addr   *uint32 // a specific address, or nil for any
	mac    [6]byte
	hasMAC bool
}

func (r allocRequest) sameMAC(al allocation) bool { return r.hasMAC && al.hasMAC && r.mac == al.mac }

// allocate takes an address for req: locally when this host owns free
// space (or the address), otherwise after obtaining space from another
// host. It returns once the allocation is on disk.
func (a *Allocator) allocate(ctx context.Context, p *pool, req allocRequest) (uint32, error) {
	rounds := 0
	for {
		// Another host may have reclaimed this host's space meanwhile
		// (learnt while waiting for space): the reclaim's error, not a
		// timeout's.
		if err := a.refuseIfReclaimed(); err != nil {
			return 0, err
		}
		p.mu.Lock()
		x, wait, needSpace, err := a.allocateLocked(p, req)
		p.mu.Unlock()
		switch {
		case err != nil:
			return 0, err
		case needSpace:
			if err := a.obtain(ctx, p, req.addr); err != nil {
				if rerr := a.refuseIfReclaimed(); rerr != nil {
					return 0, rerr
				}
				// An owner that did not answer gets another chance
				// while the request has time for it.
				var re *retryableError
				d, ok := ctx.Deadline()
				if rounds++; errors.As(err, &re) && rounds < maxObtainRounds && (!ok || time.Until(d) > a.timing.donate) {
					continue
				}
				return 0, err
			}
			continue
		}
		if wait == 0 {
			return x, nil
		}
		if err := a.journal.wait(wait); err != nil {
			p.mu.Lock()
			if al, ok := p.allocs.get(x); ok && al.seq == wait {
				p.allocs.remove(x)
				a.journal.mark1(allocKey(p.id, x), nil)
			}
			p.mu.Unlock()
			return 0, refuse(ReasonStateFile, fmt.Errorf("failed to record %s in the state file: %w", addrOf(x), err))
		}
		p.mu.Lock()
		if al, ok := p.allocs.get(x); ok && al.seq == wait {
			al.seq = 0
			p.allocs.put(x, al)
		}
		p.mu.Unlock()
		return x, nil
	}
}

// allocateLocked allocates in memory and marks the allocation in the
// journal; wait is the mark to wait for (0: already on disk). needSpace:
// this host must obtain space (or the address) from another host first.
func (a *Allocator) allocateLocked(p *pool, req allocRequest) (x uint32, wait uint64, needSpace bool, err error) {
	if req.addr != nil {
		x = *req.addr
		if al, ok := p.allocs.get(x); ok {
			if req.sameMAC(al) {
				return x, al.seq, false, nil // a replay of the request that allocated it
			}
			return 0, 0, false, refuse(ReasonInUse, fmt.Errorf("%s is in use on this host", addrOf(x)))
		}
		if p.ring.ownerOf(x) != a.self {
			return 0, 0, true, nil
		}
		return x, a.take(p, x, req), false, nil
	}
	if req.hasMAC {
		// A retry of a request whose answer was lost (the endpoint's MAC
		// already holds an address of this pool here): the same answer.
		if y, ok := p.allocs.withMAC(req.mac); ok {
			return y, p.allocs.byAddr[y].seq, false, nil
		}
	}
	if x, ok := p.findFree(a.self); ok {
		return x, a.take(p, x, req), false, nil
	}
	return 0, 0, true, nil
}

// take allocates x (owned by this host, free) and marks it.
func (a *Allocator) take(p *pool, x uint32, req allocRequest) uint64 {
	al := allocation{mac: req.mac, hasMAC: req.hasMAC, at: a.now().Unix()}
	seq := a.journal.mark1(allocKey(p.id, x), encodeAlloc(al))
	al.seq = seq
	p.allocs.put(x, al)
	p.next = x + 1
	if x == p.spec.hi {
		p.next = p.spec.lo
	}
	return seq
}

// findFree returns a free address this host owns, searching round robin
// from p.next.
func (p *pool) findFree(self Identity) (uint32, bool) {
	spans := p.ring.owned(self)
	if len(spans) == 0 {
		return 0, false
	}
	// The span holding or following next, then the rest, wrapping.
	start := sort.Search(len(spans), func(i int) bool { return spans[i].last >= p.next })
	for k := range len(spans) + 1 {
		sp := spans[(start+k)%len(spans)]
		from := sp.first
		if k == 0 {
			from = max(p.next, sp.first)
		}
		if x, ok := p.allocs.firstFree(sp, from); ok {
			return x, true
		}
	}
	return 0, false
}

// releaseAddress is ReleaseAddress; what it refuses without a reason of its own is bad input.
func (a *Allocator) releaseAddress(ctx context.Context, poolID, addr string) error {
	spec, err := parsePoolID(poolID)
	if err != nil {
		return err
	}
	ip, err := netip.ParseAddr(addr)
	if err != nil || !ip.Is4() {
		// dockerd sends the address without a prefix length; accept one.
		pfx, perr := netip.ParsePrefix(addr)
		if perr != nil || !pfx.Addr().Is4() {
			return fmt.Errorf("Address %q is not an IPv4 address", addr)
		}
		ip = pfx.Addr()
	}
	if !spec.prefix.Contains(ip) {
		return fmt.Errorf("Address %s is outside the pool's subnet %s", ip, spec.prefix)
	}
	if ip == spec.gatewayAddr() {
		return nil
	}
	p := a.lookupPool(spec.id())
	if p == nil {
		return fmt.Errorf("Address %s is not allocated on this host (PoolID %s was not requested here)", ip, poolID)
	}
	x := u32(ip)
	p.mu.Lock()
	if _, ok := p.allocs.get(x); !ok {
		p.mu.Unlock()
		return fmt.Errorf("Address %s is not allocated on this host (PoolID %s)", ip, poolID)
	}
	p.allocs.remove(x)
	delete(p.conflicts, x)
	seq := a.journal.mark1(allocKey(p.id, x), nil)
	p.mu.Unlock()
	if err := a.journal.wait(seq); err != nil {
		return refuse(ReasonStateFile, fmt.Errorf("failed to record the release of %s in the state file: %w", ip, err))
	}
	return nil
}
