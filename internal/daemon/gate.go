package daemon

import (
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/docker/go-plugins-helpers/network"
)

var errShuttingDown = errors.New("overlayd is shutting down")

// gate wraps a network.Driver so that shutdown can stop new calls and wait
// for the calls in flight (dockerd keeps its connections open, so closing the
// listener alone does not stop requests).
type gate struct {
	d   network.Driver
	log *slog.Logger
	// observe, if set, is told of every call as it ends (the metrics);
	// it must not block.
	observe func(method string, err error, took time.Duration)
	mu      sync.Mutex
	closed  bool           // guarded by mu
	wg      sync.WaitGroup // calls in flight
}

func (g *gate) enter() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return errShuttingDown
	}
	g.wg.Add(1)
	return nil
}

// close refuses new calls and waits for the ones in flight.
func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
	g.wg.Wait()
}

func call[Req, Resp any](g *gate, name string, fn func(Req) (Resp, error), req Req) (Resp, error) {
	if err := g.enter(); err != nil {
		var zero Resp
		return zero, err
	}
	defer g.wg.Done()
	start := time.Now()
	resp, err := fn(req)
	if g.observe != nil {
		g.observe(name, err, time.Since(start))
	}
	if err != nil {
		g.log.Warn("plugin call failed", "method", name, "error", err, "duration", time.Since(start))
	} else {
		g.log.Debug("plugin call", "method", name, "duration", time.Since(start))
	}
	return resp, err
}

func call0[Req any](g *gate, name string, fn func(Req) error, req Req) error {
	_, err := call(g, name, func(r Req) (struct{}, error) { return struct{}{}, fn(r) }, req)
	return err
}

func (g *gate) GetCapabilities() (*network.CapabilitiesResponse, error) {
	return call(g, "GetCapabilities", func(struct{}) (*network.CapabilitiesResponse, error) { return g.d.GetCapabilities() }, struct{}{})
}
func (g *gate) CreateNetwork(r *network.CreateNetworkRequest) error {
	return call0(g, "CreateNetwork", g.d.CreateNetwork, r)
}
func (g *gate) AllocateNetwork(r *network.AllocateNetworkRequest) (*network.AllocateNetworkResponse, error) {
	return call(g, "AllocateNetwork", g.d.AllocateNetwork, r)
}
func (g *gate) DeleteNetwork(r *network.DeleteNetworkRequest) error {
	return call0(g, "DeleteNetwork", g.d.DeleteNetwork, r)
}
func (g *gate) FreeNetwork(r *network.FreeNetworkRequest) error {
	return call0(g, "FreeNetwork", g.d.FreeNetwork, r)
}
func (g *gate) CreateEndpoint(r *network.CreateEndpointRequest) (*network.CreateEndpointResponse, error) {
	return call(g, "CreateEndpoint", g.d.CreateEndpoint, r)
}
func (g *gate) DeleteEndpoint(r *network.DeleteEndpointRequest) error {
	return call0(g, "DeleteEndpoint", g.d.DeleteEndpoint, r)
}
func (g *gate) EndpointInfo(r *network.InfoRequest) (*network.InfoResponse, error) {
	return call(g, "EndpointInfo", g.d.EndpointInfo, r)
}
func (g *gate) Join(r *network.JoinRequest) (*network.JoinResponse, error) {
	return call(g, "Join", g.d.Join, r)
}
func (g *gate) Leave(r *network.LeaveRequest) error { return call0(g, "Leave", g.d.Leave, r) }
func (g *gate) DiscoverNew(r *network.DiscoveryNotification) error {
	return call0(g, "DiscoverNew", g.d.DiscoverNew, r)
}
func (g *gate) DiscoverDelete(r *network.DiscoveryNotification) error {
	return call0(g, "DiscoverDelete", g.d.DiscoverDelete, r)
}
func (g *gate) ProgramExternalConnectivity(r *network.ProgramExternalConnectivityRequest) error {
	return call0(g, "ProgramExternalConnectivity", g.d.ProgramExternalConnectivity, r)
}
func (g *gate) RevokeExternalConnectivity(r *network.RevokeExternalConnectivityRequest) error {
	return call0(g, "RevokeExternalConnectivity", g.d.RevokeExternalConnectivity, r)
}
