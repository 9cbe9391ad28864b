package netsync

import (
	"context"

	"github.com/overlayd/overlayd/internal/engine"
	"github.com/overlayd/overlayd/internal/netspec"
)

// EngineAPI is Engine over the local engine's API client.
type EngineAPI struct{ E *engine.Engine }

// Networks implements Engine.
func (a EngineAPI) Networks(ctx context.Context, driver string) ([]Network, error) {
	ins, err := a.E.Networks(ctx, driver)
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
func (a EngineAPI) Create(ctx context.Context, s netspec.Spec, driver string) (string, error) {
	return a.E.CreateNetwork(ctx, s.Name, s.CreateOptions(driver))
}

// Remove implements Engine.
func (a EngineAPI) Remove(ctx context.Context, id string) error { return a.E.RemoveNetwork(ctx, id) }
