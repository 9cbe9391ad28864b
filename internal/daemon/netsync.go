package daemon

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/engine"
	"github.com/overlayd/overlayd/internal/netsync"
	"github.com/overlayd/overlayd/internal/statefile"
)

// netSyncService runs networks defined once (docs/networks.md): it finds
// the local engine's name of overlayd's driver, then runs the syncer, fed
// by the engine's network events and by the cluster's application
// messages and membership changes. The syncer owns the entries and the
// ledger; this only wires it.
type netSyncService struct {
	log     *slog.Logger
	eng     *engine.Engine
	st      *config.Settings
	db      *statefile.File
	cluster func() *cluster.Cluster

	ctx    context.Context
	cancel context.CancelFunc
	done   sync.WaitGroup
	ready  chan struct{}   // closed once s is set
	s      *netsync.Syncer // set once, before ready is closed
}

// newNetSyncService makes the service, or nil (with one INFO line saying
// why) when the feature is off or the engine's socket is not there (a
// managed plugin installed without the engine mount).
func newNetSyncService(st *config.Settings, log *slog.Logger, db *statefile.File, c func() *cluster.Cluster) (*netSyncService, error) {
	log = log.With("component", "netsync")
	if !st.NetSync {
		log.Info("networks defined once are off (" + st.Source("netsync") + " off): each host's networks are its own")
		return nil, nil
	}
	if _, err := os.Stat(st.EngineSocket); err != nil {
		log.Info("networks defined once are off: the engine's API socket is not here (a managed plugin needs its 'engine' mount; docs/networks.md)",
			"socket", st.EngineSocket, "error", err)
		return nil, nil
	}
	eng, err := engine.Open(st.EngineSocket, log)
	if err != nil {
		return nil, &config.Invalid{Err: err}
	}
	ns := &netSyncService{log: log, eng: eng, st: st, db: db, cluster: c, ready: make(chan struct{})}
	ns.ctx, ns.cancel = context.WithCancel(context.Background())
	return ns, nil
}

// start finds the driver's name (retrying while the engine does not
// answer: it may start after overlayd), then runs the syncer.
func (ns *netSyncService) start() {
	ns.done.Add(1)
	go func() {
		defer ns.done.Done()
		driver := ns.driverName()
		if driver == "" {
			return // stopped
		}
		s, err := netsync.New(netsync.Config{
			Host: ns.st.NodeName, Driver: driver, Engine: &netsync.EngineAPI{E: ns.eng},
			Transport: netSyncTransport{ns.cluster}, Store: ns.db, Log: ns.log,
		})
		if err != nil {
			ns.log.Error("networks defined once cannot start", "error", err)
			return
		}
		ns.s = s
		close(ns.ready)
		ns.log.Info("networks defined once: on", "driver", driver, "engine", ns.eng.Socket())
		ns.done.Add(1)
		go func() {
			defer ns.done.Done()
			ns.eng.WatchNetworks(ns.ctx, time.Second, s.Poke)
		}()
		s.Run(ns.ctx)
	}()
}

// driverName is the setting, or the one enabled managed plugin serving
// overlayd's socket, or the plugin socket's name (a plugin found by its
// socket in /run/docker/plugins is named after it). "" once stopped.
func (ns *netSyncService) driverName() string {
	if ns.st.DriverName != "" {
		return ns.st.DriverName
	}
	sock := filepath.Base(ns.st.Socket)
	logged := ""
	for {
		ctx, cancel := context.WithTimeout(ns.ctx, 10*time.Second)
		names, err := ns.eng.ManagedPlugins(ctx, sock)
		cancel()
		switch {
		case err == nil && len(names) == 1:
			return names[0]
		case err == nil:
			if len(names) > 1 {
				ns.log.Warn("several managed plugins serve overlayd's socket: networks defined once use the socket's name; set "+ns.st.Source("driver-name")+" to choose",
					"plugins", strings.Join(names, ","))
			}
			return strings.TrimSuffix(sock, ".sock")
		}
		if msg := err.Error(); msg != logged {
			logged = msg
			ns.log.Info("networks defined once wait for the engine (logged again only if the error changes)", "error", err)
		}
		select {
		case <-ns.ctx.Done():
			return ""
		case <-time.After(time.Second):
		}
	}
}

// syncer is the running syncer, or nil before it started.
func (ns *netSyncService) syncer() *netsync.Syncer {
	if ns == nil {
		return nil
	}
	select {
	case <-ns.ready:
		return ns.s
	default:
		return nil
	}
}

// handleMessage and membersChanged never block (cluster callbacks).
func (ns *netSyncService) handleMessage(from string, payload []byte) {
	if s := ns.syncer(); s != nil {
		s.HandleMessage(from, payload)
	}
}

func (ns *netSyncService) membersChanged() {
	if s := ns.syncer(); s != nil {
		s.MembersChanged()
	}
}

// status is the netsync section of overlayd status (nil when off or not
// started).
func (ns *netSyncService) status() *netsync.Status {
	s := ns.syncer()
	if s == nil {
		return nil
	}
	st := s.Status()
	return &st
}

func (ns *netSyncService) close() {
	if ns == nil {
		return
	}
	ns.cancel()
	ns.done.Wait()
	ns.eng.Close()
}

// netSyncTransport is the cluster's application messages, once the
// cluster runs (before: no members, nothing sent).
type netSyncTransport struct{ c func() *cluster.Cluster }

func (t netSyncTransport) Members() []string {
	c := t.c()
	if c == nil {
		return nil
	}
	var out []string
	for _, m := range c.AppMembers() {
		if m.App && m.State == cluster.StateAlive {
			out = append(out, m.Name)
		}
	}
	return out
}

func (t netSyncTransport) Send(node string, payload []byte) error {
	c := t.c()
	if c == nil {
		return cluster.ErrNotReachable
	}
	return c.SendApp(node, payload)
}
