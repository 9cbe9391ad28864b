package engine

import (
	"context"
	"fmt"
	"time"

	cerrdefs "github.com/containerd/errdefs"

	"github.com/moby/moby/api/types/events"
	"github.com/moby/moby/api/types/network"
	"github.com/moby/moby/client"
)

// Networks inspects every network of the engine whose driver is driver
// (the engine's name of it: "overlayd", or a managed plugin's
// "overlayd:latest"). Networks removed while it lists are left out.
func (e *Engine) Networks(ctx context.Context, driver string) ([]network.Inspect, error) {
	list, err := e.cli.NetworkList(ctx, client.NetworkListOptions{Filters: make(client.Filters).Add("driver", driver)})
	if err != nil {
		return nil, fmt.Errorf("list networks of driver %s of the engine at %s: %w", driver, e.socket, err)
	}
	out := make([]network.Inspect, 0, len(list.Items))
	for _, s := range list.Items {
		if s.Driver != driver {
			continue // older engines match the filter as a substring
		}
		res, err := e.cli.NetworkInspect(ctx, s.ID, client.NetworkInspectOptions{})
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if cerrdefs.IsNotFound(err) {
				continue // removed meanwhile
			}
			return nil, fmt.Errorf("inspect network %s (%s) of the engine at %s: %w", s.Name, s.ID, e.socket, err)
		}
		out = append(out, res.Network)
	}
	return out, nil
}

// CreateNetwork creates a network and returns its ID.
func (e *Engine) CreateNetwork(ctx context.Context, name string, o client.NetworkCreateOptions) (string, error) {
	res, err := e.cli.NetworkCreate(ctx, name, o)
	if err != nil {
		return "", fmt.Errorf("create network %s on the engine at %s: %w", name, e.socket, err)
	}
	return res.ID, nil
}

// RemoveNetwork removes the network id; the engine refuses one that a
// container uses.
func (e *Engine) RemoveNetwork(ctx context.Context, id string) error {
	if _, err := e.cli.NetworkRemove(ctx, id, client.NetworkRemoveOptions{}); err != nil {
		return fmt.Errorf("remove network %s on the engine at %s: %w", id, e.socket, err)
	}
	return nil
}

// WatchNetworks calls changed (which must not block) after every network
// create, destroy, connect or disconnect and after each (re)connection to
// the engine, until ctx ends; like Watch, a broken stream is reopened
// after retry.
func (e *Engine) WatchNetworks(ctx context.Context, retry time.Duration, changed func()) {
	f := make(client.Filters).
		Add("type", string(events.NetworkEventType)).
		Add("event", "create", "destroy", "connect", "disconnect")
	e.watch(ctx, retry, f, changed)
}

// ManagedPlugins lists the enabled managed plugins that serve a network
// driver on a socket named socket (overlayd's plugin serves
// "overlayd.sock"), by the name networks show as their driver.
func (e *Engine) ManagedPlugins(ctx context.Context, socket string) ([]string, error) {
	res, err := e.cli.PluginList(ctx, client.PluginListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list plugins of the engine at %s: %w", e.socket, err)
	}
	var out []string
	for _, p := range res.Items {
		if !p.Enabled || p.Config.Interface.Socket != socket {
			continue
		}
		for _, t := range p.Config.Interface.Types {
			if t.Capability == "networkdriver" {
				out = append(out, p.Name)
				break
			}
		}
	}
	return out, nil
}
