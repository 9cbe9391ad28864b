package daemon

import (
	"context"
	"errors"
	"log/slog"

	ipamapi "github.com/docker/go-plugins-helpers/ipam"

	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/ipam"
	"github.com/overlayd/overlayd/internal/pluginapi"
)

// gatewayKey is libnetwork's netlabel.Gateway: a RequestPool answer whose
// Data holds it gives dockerd the network's gateway, so dockerd asks for
// none (and every host has the same one, the pool's first address).
const gatewayKey = "com.docker.network.gateway"

// ipamAPI answers dockerd's IpamDriver calls with the cluster allocator:
// it only translates between the remote API's strings and the allocator's
// types; every check and every error text is the allocator's.
type ipamAPI struct {
	a   *ipam.Allocator
	log *slog.Logger // each request at debug: what dockerd asked (replays included)
	// refused, if set, is told why each request was refused (the
	// metrics' counter by reason); it must not block.
	refused func(reason string)
}

// refusal is what an allocator error may implement to name its reason for
// the metrics (a short, fixed word such as "pool_full"); any other error
// counts as "other".
type refusal interface {
	error
	RefusalReason() string
}

func (p *ipamAPI) count(err error) error {
	if err != nil && p.refused != nil {
		reason := "other"
		if r, ok := errors.AsType[refusal](err); ok && r.RefusalReason() != "" {
			reason = r.RefusalReason()
		}
		p.refused(reason)
	}
	return err
}

func (p *ipamAPI) GetCapabilities(context.Context) (*pluginapi.IPAMCapabilities, error) {
	c := p.a.Capabilities()
	return &pluginapi.IPAMCapabilities{RequiresMACAddress: c.RequiresMACAddress, RequiresRequestReplay: c.RequiresRequestReplay}, nil
}

func (p *ipamAPI) GetDefaultAddressSpaces(context.Context) (*ipamapi.AddressSpacesResponse, error) {
	return &ipamapi.AddressSpacesResponse{LocalDefaultAddressSpace: ipam.AddressSpace, GlobalDefaultAddressSpace: ipam.AddressSpace}, nil
}

func (p *ipamAPI) RequestPool(ctx context.Context, r *ipamapi.RequestPoolRequest) (*ipamapi.RequestPoolResponse, error) {
	p.log.Debug("ipam request", "call", "RequestPool", "address_space", r.AddressSpace, "pool", r.Pool, "sub_pool", r.SubPool, "v6", r.V6, "options", r.Options)
	res, err := p.a.RequestPool(ctx, ipam.PoolRequest{AddressSpace: r.AddressSpace, Pool: r.Pool, SubPool: r.SubPool, V6: r.V6, Options: r.Options})
	if err := p.count(err); err != nil {
		return nil, err
	}
	out := &ipamapi.RequestPoolResponse{PoolID: res.PoolID, Pool: res.Pool.String()}
	if res.Gateway.IsValid() {
		out.Data = map[string]string{gatewayKey: res.Gateway.String()}
	}
	return out, nil
}

func (p *ipamAPI) ReleasePool(ctx context.Context, r *ipamapi.ReleasePoolRequest) error {
	p.log.Debug("ipam request", "call", "ReleasePool", "pool_id", r.PoolID)
	return p.count(p.a.ReleasePool(ctx, r.PoolID))
}

func (p *ipamAPI) RequestAddress(ctx context.Context, r *ipamapi.RequestAddressRequest) (*ipamapi.RequestAddressResponse, error) {
	p.log.Debug("ipam request", "call", "RequestAddress", "pool_id", r.PoolID, "address", r.Address, "options", r.Options)
	addr, err := p.a.RequestAddress(ctx, ipam.AddressRequest{PoolID: r.PoolID, Address: r.Address, Options: r.Options})
	if err := p.count(err); err != nil {
		return nil, err
	}
	return &ipamapi.RequestAddressResponse{Address: addr.String()}, nil
}

func (p *ipamAPI) ReleaseAddress(ctx context.Context, r *ipamapi.ReleaseAddressRequest) error {
	p.log.Debug("ipam request", "call", "ReleaseAddress", "pool_id", r.PoolID, "address", r.Address)
	return p.count(p.a.ReleaseAddress(ctx, r.PoolID, r.Address))
}

// ipamGate passes the IpamDriver calls through the plugin gate, as the
// network driver's: shutdown waits for them, the metrics observe them
// (method "IpamDriver.<call>"), failures are logged.
type ipamGate struct {
	g     *gate
	inner pluginapi.IPAM
}

func (i ipamGate) GetCapabilities(ctx context.Context) (*pluginapi.IPAMCapabilities, error) {
	return call(i.g, "IpamDriver.GetCapabilities", i.inner.GetCapabilities, ctx)
}

func (i ipamGate) GetDefaultAddressSpaces(ctx context.Context) (*ipamapi.AddressSpacesResponse, error) {
	return call(i.g, "IpamDriver.GetDefaultAddressSpaces", i.inner.GetDefaultAddressSpaces, ctx)
}

func (i ipamGate) RequestPool(ctx context.Context, r *ipamapi.RequestPoolRequest) (*ipamapi.RequestPoolResponse, error) {
	return call(i.g, "IpamDriver.RequestPool", func(r *ipamapi.RequestPoolRequest) (*ipamapi.RequestPoolResponse, error) {
		return i.inner.RequestPool(ctx, r)
	}, r)
}

func (i ipamGate) ReleasePool(ctx context.Context, r *ipamapi.ReleasePoolRequest) error {
	return call0(i.g, "IpamDriver.ReleasePool", func(r *ipamapi.ReleasePoolRequest) error { return i.inner.ReleasePool(ctx, r) }, r)
}

func (i ipamGate) RequestAddress(ctx context.Context, r *ipamapi.RequestAddressRequest) (*ipamapi.RequestAddressResponse, error) {
	return call(i.g, "IpamDriver.RequestAddress", func(r *ipamapi.RequestAddressRequest) (*ipamapi.RequestAddressResponse, error) {
		return i.inner.RequestAddress(ctx, r)
	}, r)
}

func (i ipamGate) ReleaseAddress(ctx context.Context, r *ipamapi.ReleaseAddressRequest) error {
	return call0(i.g, "IpamDriver.ReleaseAddress", func(r *ipamapi.ReleaseAddressRequest) error { return i.inner.ReleaseAddress(ctx, r) }, r)
}

// ipamTransport adapts the cluster's application messages to the
// allocator's Transport (internal/cluster must not import internal/ipam).
type ipamTransport struct{ c *cluster.Cluster }

func (t ipamTransport) Send(node string, payload []byte) error { return t.c.SendApp(node, payload) }

func (t ipamTransport) Joined() bool { return t.c.Joined() }

// Members lists the members that take part in the address management:
// those that speak the cluster's application messages. A member running
// an overlayd from before them has no allocator: it can neither vote nor
// own addresses, so it is not a voter (counting it would make every claim
// wait for a vote that never comes).
func (t ipamTransport) Members() []ipam.Member {
	var out []ipam.Member
	for _, m := range t.c.AppMembers() {
		if !m.App {
			continue
		}
		st := ipam.Alive
		switch m.State {
		case cluster.StateSuspect:
			st = ipam.Suspect
		case cluster.StateDead:
			st = ipam.Dead
		}
		out = append(out, ipam.Member{Name: m.Name, State: st})
	}
	return out
}
