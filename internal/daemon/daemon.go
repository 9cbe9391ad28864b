// Package daemon runs overlayd's plugin server: it opens the driver and
// the cluster address management (internal/ipam), serves both remote APIs
// (network driver and IPAM driver) on the plugin socket and shuts down
// gracefully.
// With --metrics-addr it also serves Prometheus metrics and the health
// endpoints (internal/metrics), reading every owner at scrape time.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	sdnotify "github.com/coreos/go-systemd/daemon"
	"github.com/vishvananda/netns"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/control"
	"github.com/overlayd/overlayd/internal/ipam"
	"github.com/overlayd/overlayd/internal/metrics"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/nlbatch"
	"github.com/overlayd/overlayd/internal/pluginapi"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/internal/version"
)

// Run serves until ctx is cancelled, then stops accepting, finishes the calls
// in flight and returns nil. Kernel state is left in place.
//
// Settings that do not fit this host, and an unusable cluster key, are
// refused first, before anything is created, as a *config.Invalid.
func Run(ctx context.Context, st *config.Settings, log *slog.Logger) error {
	if err := st.CheckHost(); err != nil {
		return err
	}
	// The metrics listener first, so that an address that cannot be
	// bound is refused before anything is created.
	var ml net.Listener
	if st.MetricsAddr != "" {
		l, err := net.Listen("tcp", st.MetricsAddr)
		if err != nil {
			return &config.Invalid{Err: fmt.Errorf("%s %q: cannot listen there: %v; give an IP:port of this host that is free, or leave it unset to serve no metrics",
				st.Source("metrics-addr"), st.MetricsAddr, err)}
		}
		ml = l
		defer ml.Close()
	}
	key, err := loadKey(st, log)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(st.StateDir, 0o700); err != nil {
		return fmt.Errorf("failed to create state directory %s: %w", st.StateDir, err)
	}
	if err := netnsutil.MakeSharedMount(st.NetnsDir); err != nil {
		return err
	}
	db, err := statefile.Open(st.StateDir)
	if err != nil {
		return err
	}
	defer db.Close()
	// The address management's state is in the state file too: it is
	// loaded (or this host's identity created) before anything serves.
	alloc, err := ipam.New(ipam.Config{NodeName: st.NodeName, Store: db, Logger: log.With("component", "ipam")})
	if err != nil {
		return fmt.Errorf("failed to load the address management's state from %s: %w", db.Path(), err)
	}
	defer alloc.Close()
	hostNS, err := netns.Get()
	if err != nil {
		return fmt.Errorf("failed to open the host network namespace: %w", err)
	}
	defer hostNS.Close()
	enc, err := encryption.NewOwner(encryption.OwnerConfig{
		NS: hostNS, Port: st.VXLANPort, Secret: key, Store: db, Logger: log.With("component", "encryption"),
		RotateEvery: st.KeyRotationInterval,
	})
	if err != nil {
		return err
	}
	defer enc.Close()
	// The control plane's side the driver calls, then the driver, then
	// the control plane that runs the cluster for it (cluster.go).
	link := newClusterLink(st, log, enc)
	names, err := newNameService(st, log, hostNS, link.c.Load)
	if err != nil {
		return err
	}
	defer names.close()
	nsync, err := newNetSyncService(st, log, db, link.c.Load)
	if err != nil {
		return err
	}
	defer nsync.close()
	dcfg := driver.Config{
		Scope:         st.Scope,
		AdvertiseAddr: st.AdvertiseAddr,
		VXLANPort:     st.VXLANPort,
		NetnsDir:      st.NetnsDir,
		Logger:        log,
		StateFile:     db,
		Publisher:     link,
		Peers:         link,
		Definitions:   link,
		Membership:    link,
		Encryption:    enc,
		HostNS:        hostNS,
	}
	if names != nil {
		dcfg.NameServer, dcfg.DNSAddress = names, st.DNSAddress
	}
	d, err := driver.New(dcfg)
	if err != nil {
		return err
	}
	defer d.Close()
	cp := newControlPlane(st, db, log, key, enc, alloc, link, d, names, nsync)
	if names != nil {
		names.start(d)
	}
	if vtep := d.VTEP(); vtep.IsValid() {
		if err := enc.SetLocal(vtep); err != nil {
			log.Warn("encryption state for the local VTEP (retried by its loop)", "vtep", vtep, "error", err)
		}
	}
	enc.Start()
	// Checked at start (and again whenever an encrypted network is created
	// or joined): say up front whether encrypted networks can work here.
	if err := enc.CheckSupport(); err != nil {
		log.Warn("encrypted networks are unavailable on this host (they will be refused, never sent in clear)", "reason", err)
	} else {
		log.Info("encrypted networks available (ESP/AEAD supported by the kernel)")
	}

	// The plugin socket first: dockerd disables a managed plugin whose socket
	// is late, and joining the cluster may take long.
	l, err := listen(st.Socket)
	if err != nil {
		return err
	}
	ctl, err := control.Serve(st.ControlSocket, control.Handlers{
		Status: func() any {
			ist := alloc.Status()
			r := &StatusReport{Cluster: link.status(), Driver: d.Status(), IPAM: &ist, Ready: readiness(cp.ready())}
			if c := link.c.Load(); c != nil {
				r.Keys = memberKeys(c)
			}
			if names != nil {
				r.Names = names.status.Load()
			}
			r.NetSync = nsync.status()
			return r
		},
		Rotate: func() (any, error) {
			if err := cp.canRotate(); err != nil {
				return nil, err
			}
			target, err := enc.Rotate()
			if err != nil {
				return nil, fmt.Errorf("key rotation cannot start: %w", err)
			}
			return map[string]any{"target_epoch": target, "note": "every host accepts the new epoch, then sends with it, then retires the old one"}, nil
		},
		Leave: cp.leave,
		Reclaim: func(ctx context.Context, node string) (any, error) {
			return alloc.Reclaim(ctx, node)
		},
	})
	if err != nil {
		l.Close()
		os.Remove(st.Socket)
		return err
	}
	defer ctl.Close()
	g := &gate{d: d, log: log}
	ia := &ipamAPI{a: alloc, log: log.With("component", "ipam")}
	var msrv *http.Server
	if ml != nil {
		m := metrics.New(metrics.Sources{
			Driver:         d.Status,
			DriverCounters: d.Counters,
			Audit:          d.Audit,
			Cluster:        link.status,
			Rotations:      enc.RotationDurations,
			StateWrites:    db.WriteLatency,
			Netlink: func() (uint64, uint64, uint64) {
				c := nlbatch.Sent()
				return c.Messages, c.Datagrams, c.SendFailures
			},
			IPAM: func() *ipam.Status {
				st := alloc.Status()
				return &st
			},
			Ready:   cp.ready,
			Version: version.String(),
		})
		if names != nil {
			m.Register(names.srv.Collector())
		}
		if nsync != nil {
			m.Register(newNetSyncCollector(nsync))
		}
		g.observe = m.ObserveCall
		ia.refused = m.ObserveIPAMRefusal
		msrv = &http.Server{Handler: m.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := msrv.Serve(ml); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("metrics server stopped", "addr", st.MetricsAddr, "error", err)
			}
		}()
		log.Info("serving metrics", "addr", ml.Addr().String(), "paths", "/metrics /healthz /readyz")
	}
	// One socket serves both APIs: -d overlayd --ipam-driver overlayd.
	h := pluginapi.New(g, ipamGate{g: g, inner: ia})
	served := make(chan error, 1)
	go func() { served <- h.Serve(l) }()
	// netsync creates networks through the engine, which calls this
	// plugin: only once the socket serves.
	if nsync != nil {
		nsync.start()
	}
	// The control plane starts now if the VTEP is known, else when the
	// driver settles it (DiscoverNew in swarm).
	cp.done.Add(1)
	go cp.run()
	cp.tryStart()
	// Only what is known: an unknown VTEP is said so (and what will
	// provide it), and logged when it is settled ("local VTEP settled",
	// then "control plane started").
	serving := []any{"version", version.String(), "socket", st.Socket, "scope", st.Scope, "vxlan_port", st.VXLANPort,
		"netns_dir", st.NetnsDir, "state_dir", st.StateDir}
	if vtep := d.VTEP(); vtep.IsValid() {
		log.Info("overlayd serving", append(serving, "vtep", vtep, "vtep_source", d.Status().VTEPSource)...)
	} else {
		log.Info("overlayd serving", append(serving, "vtep", "unknown yet")...)
		log.Info("the control plane waits for this host's address (the VTEP) and starts once it is known",
			"provided_by", vtepProvider(st.Scope), "or_set", st.Source("advertise-addr"))
	}
	// Under systemd (Type=notify, packaging/systemd), units ordered after
	// overlayd's (docker.service) start only now that the socket answers.
	// NOTIFY_SOCKET is unset so that nothing started later sends as us.
	if sent, err := sdnotify.SdNotify(true, sdnotify.SdNotifyReady); err != nil {
		log.Warn("could not tell systemd that overlayd is serving", "notify_socket_error", err)
	} else if sent {
		log.Debug("told systemd that overlayd is serving")
	}

	var runErr error
	select {
	case <-ctx.Done():
	case err := <-served:
		runErr = fmt.Errorf("plugin server stopped: %w", err)
	case err := <-ctl.Done():
		runErr = fmt.Errorf("control socket server stopped: %w", err)
	}
	log.Info("shutting down: no new calls, waiting for calls in flight")
	if msrv != nil {
		msrv.Close()
	}
	l.Close()
	g.close()
	cp.close()
	os.Remove(st.Socket)
	log.Info("overlayd stopped; kernel state left in place and the cluster not left (other hosts keep this host's peers through a restart)")
	return runErr
}

// vtepProvider says what will settle an unknown VTEP (driver/vtep.go has
// the precedence).
func vtepProvider(scope string) string {
	if scope == "global" {
		return "swarm: dockerd's DiscoverNew for this node, sent once the engine is in a swarm and has loaded this driver"
	}
	return fmt.Sprintf("the first IPv4 address of the default route's device, re-read every %s (there is no IPv4 default route with an address yet)", reconcileInterval)
}

// listen creates the plugin socket (mode 0660), replacing a stale socket file
// left by a process that died, but refusing to steal one that is in use.
func listen(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("failed to create socket directory for %s: %w", path, err)
	}
	if _, err := os.Lstat(path); err == nil {
		c, derr := net.DialTimeout("unix", path, time.Second)
		if derr == nil {
			c.Close()
			return nil, fmt.Errorf("socket %s is in use by another process (is overlayd already running?)", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("failed to remove stale socket %s: %w", path, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("failed to check socket %s: %w", path, err)
	}
	// Bind under a temporary name, set the mode, then rename: the socket
	// appears at path only with mode 0660, so nothing connects to it (or
	// sees it) while it still has the umask's mode.
	tmp := fmt.Sprintf("%s.%d.tmp", path, os.Getpid())
	os.Remove(tmp) // a leftover of a crash of this very pid: never in use
	l, err := net.Listen("unix", tmp)
	if err != nil {
		return nil, fmt.Errorf("failed to listen on %s: %w", tmp, err)
	}
	// The listener must not remove tmp when closed: it is renamed.
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Chmod(tmp, 0o660); err != nil {
		l.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("failed to set mode of %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		l.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("failed to move socket %s to %s: %w", tmp, path, err)
	}
	return l, nil
}
