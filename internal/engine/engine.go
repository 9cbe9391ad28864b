// Package engine reads what overlayd needs of its local Docker Engine and
// dockerd never sends a driver: the names of each endpoint's container.
// It uses the Engine API through moby's own client, over a unix socket,
// negotiating the API version (20.10 speaks 1.41, 29 refuses below 1.44:
// never pin one). What it reads is a level: Names lists everything now;
// Watch only says when to list again (container and network events), and
// the caller also lists on a tick, so a lost event or an engine restart
// converges.
package engine

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/moby/moby/api/types/events"
	"github.com/moby/moby/client"
)

// DefaultSocket is where dockerd serves its API.
const DefaultSocket = "/var/run/docker.sock"

// Engine is a client of the local engine. Safe for concurrent use.
type Engine struct {
	cli    *client.Client
	socket string
	log    *slog.Logger
}

// Open makes a client of the engine at socket (a unix socket path). It
// does not connect: an engine that is down is not an error here.
func Open(socket string, log *slog.Logger) (*Engine, error) {
	if socket == "" {
		socket = DefaultSocket
	}
	if !strings.HasPrefix(socket, "/") {
		return nil, fmt.Errorf("engine socket %q: must be an absolute path of a unix socket", socket)
	}
	cli, err := client.New(client.WithHost("unix://" + socket))
	if err != nil {
		return nil, fmt.Errorf("engine socket %s: %w", socket, err)
	}
	if log == nil {
		log = slog.Default()
	}
	return &Engine{cli: cli, socket: socket, log: log}, nil
}

// Socket is the engine's API socket.
func (e *Engine) Socket() string { return e.socket }

// Close releases the client.
func (e *Engine) Close() error { return e.cli.Close() }

// EndpointNames is one endpoint of a running container and its names.
type EndpointNames struct {
	EndpointID  string
	ContainerID string
	// Names: the container's name, its aliases on that network
	// (--network-alias; compose's service and container names) and the
	// DNS names the engine gives it (API 1.44+), as the engine has them
	// (not yet canonical: dnsname.Pack).
	Names []string
}

// Names lists the endpoints of every running container with their names,
// by endpoint ID. Containers that go away while it lists are left out.
func (e *Engine) Names(ctx context.Context) (map[string]EndpointNames, error) {
	list, err := e.cli.ContainerList(ctx, client.ContainerListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list containers of the engine at %s: %w", e.socket, err)
	}
	out := make(map[string]EndpointNames)
	for _, c := range list.Items {
		// The list's network settings lack the aliases on older engines:
		// inspect each container (one call per running container, on a
		// tick and on events only).
		res, err := e.cli.ContainerInspect(ctx, c.ID, client.ContainerInspectOptions{})
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			continue // removed meanwhile
		}
		ci := res.Container
		if ci.NetworkSettings == nil {
			continue
		}
		name := strings.TrimPrefix(ci.Name, "/")
		for _, ep := range ci.NetworkSettings.Networks {
			if ep == nil || ep.EndpointID == "" {
				continue
			}
			names := make([]string, 0, 1+len(ep.Aliases)+len(ep.DNSNames))
			if name != "" {
				names = append(names, name)
			}
			names = append(names, ep.Aliases...)
			names = append(names, ep.DNSNames...)
			out[ep.EndpointID] = EndpointNames{EndpointID: ep.EndpointID, ContainerID: ci.ID, Names: names}
		}
	}
	return out, nil
}

// Watch calls changed (which must not block) after every container or
// network event that can change a name (start, die, destroy, rename,
// connect, disconnect) and after each (re)connection to the engine, until
// ctx ends. A broken stream is reopened after retry.
func (e *Engine) Watch(ctx context.Context, retry time.Duration, changed func()) {
	f := make(client.Filters).
		Add("type", string(events.ContainerEventType), string(events.NetworkEventType)).
		Add("event", "start", "die", "destroy", "rename", "connect", "disconnect")
	e.watch(ctx, retry, f, changed)
}

// watch calls changed after every event that f selects and after each
// (re)connection, until ctx ends.
func (e *Engine) watch(ctx context.Context, retry time.Duration, f client.Filters, changed func()) {
	if retry <= 0 {
		retry = time.Second
	}
	lastErr := ""
	for ctx.Err() == nil {
		sctx, cancel := context.WithCancel(ctx)
		res := e.cli.Events(sctx, client.EventsListOptions{Filters: f})
		changed() // whatever happened while the stream was down
	loop:
		for {
			select {
			case <-res.Messages:
				if lastErr != "" {
					lastErr = ""
					e.log.Info("engine event stream open again", "socket", e.socket)
				}
				changed()
			case err := <-res.Err:
				if ctx.Err() != nil {
					break loop
				}
				// Once per distinct error: an engine that is down
				// for long must not fill the log every retry.
				if msg := fmt.Sprint(err); msg != lastErr {
					lastErr = msg
					e.log.Info("engine event stream ended; reopening (logged again only if the error changes)", "socket", e.socket, "error", err, "retry", retry)
				}
				break loop
			case <-ctx.Done():
				break loop
			}
		}
		cancel()
		select {
		case <-time.After(retry):
		case <-ctx.Done():
		}
	}
}
