package netsync

import (
	"context"
	"sync/atomic"

	"github.com/overlayd/overlayd/internal/engine"
	"github.com/overlayd/overlayd/internal/netspec"
)

// EngineAPI is Engine over the local engine's API client; it counts the
// API requests it makes (Calls, for the status).
type EngineAPI struct {
	E     *engine.Engine
	calls atomic.Uint64
}

// Calls is how many Engine API requests were made.
func (a *EngineAPI) Calls() uint64 { return a.calls.Load() }

// Networks implements Engine: one list, one inspect per network.
func (a *EngineAPI) Networks(ctx context.Context, driver string) ([]Network, error) {
	ins, err := a.E.Networks(ctx, driver)
	a.calls.Add(uint64(1 + len(ins)))
	if err != nil {
		return nil, err
	}
	out := make([]Network, 0, len(ins))
	for _, in := range ins {
		n := Network{ID: in.ID, Name: in.Name, Created: in.Created, Endpoints: len(in.Containers)}
		n.Spec, n.SpecErr = netspec.FromInspect(in)
		out = append(out, n)
	}
	return out, nil
}

// Create implements Engine.
func (a *EngineAPI) Create(ctx context.Context, s netspec.Spec, driver string) (string, error) {
	a.calls.Add(1)
	return a.E.CreateNetwork(ctx, s.Name, s.CreateOptions(driver))
}

// Remove implements Engine.
func (a *EngineAPI) Remove(ctx context.Context, id string) error {
	a.calls.Add(1)
	return a.E.RemoveNetwork(ctx, id)
}
