// Package daemon runs overlayd's plugin server: it opens the driver, serves
// the remote driver API on the plugin socket and shuts down gracefully.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/control"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/store"
)

// Run serves until ctx is cancelled, then stops accepting, finishes the calls
// in flight and returns nil. Kernel state is left in place.
func Run(ctx context.Context, st *config.Settings, log *slog.Logger) error {
	if err := os.MkdirAll(st.StateDir, 0o700); err != nil {
		return fmt.Errorf("failed to create state directory %s: %w", st.StateDir, err)
	}
	if err := netnsutil.MakeSharedMount(st.NetnsDir); err != nil {
		return err
	}
	db, err := store.Open(st.StateDir)
	if err != nil {
		return err
	}
	defer db.Close()
	key, err := loadKey(st, log)
	if err != nil {
		return err
	}
	cp := &controlPlane{st: st, db: db, log: log, key: key, stop: make(chan struct{})}
	d, err := driver.New(driver.Config{
		Scope:         st.Scope,
		AdvertiseAddr: st.AdvertiseAddr,
		VXLANPort:     st.VXLANPort,
		NetnsDir:      st.NetnsDir,
		Logger:        log,
		Store:         db,
		Publisher:     cp,
		OnDiscover:    cp.discovered,
		Secret:        key,
	})
	if err != nil {
		return err
	}
	defer d.Close()
	cp.d = d
	// Checked at start (and again whenever an encrypted network is created
	// or joined): say up front whether encrypted networks can work here.
	if err := encryption.CheckKernelSupport(); err != nil {
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
			return &StatusReport{Cluster: cp.status(), Keys: cp.memberKeys(), Driver: d.Status()}
		},
		Rotate: cp.rotate,
	})
	if err != nil {
		l.Close()
		return err
	}
	defer ctl.Close()
	cp.done.Add(1)
	go cp.run()
	g := &gate{d: d, log: log}
	h := network.NewHandler(g)
	served := make(chan error, 1)
	go func() { served <- h.Serve(l) }()
	log.Info("overlayd serving", "socket", st.Socket, "scope", st.Scope, "vxlan_port", st.VXLANPort,
		"netns_dir", st.NetnsDir, "state_dir", st.StateDir, "advertise_addr", st.AdvertiseAddr)

	select {
	case <-ctx.Done():
	case err := <-served:
		return fmt.Errorf("plugin server stopped: %w", err)
	}
	log.Info("shutting down: no new calls, waiting for calls in flight")
	l.Close()
	g.close()
	cp.close()
	os.Remove(st.Socket)
	log.Info("overlayd stopped; kernel state left in place")
	return nil
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
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("failed to listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o660); err != nil {
		l.Close()
		return nil, fmt.Errorf("failed to set mode of %s: %w", path, err)
	}
	return l, nil
}
