package driver

import (
	"errors"
	"fmt"
	"os"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
)

// Audit compares the kernel with the driver's state and returns every
// difference, each naming its network and object; empty means they agree.
// For each network it locks the network in turn (never two at once). It
// checks every sandbox (links, MTUs, bridge membership, neighbours, FDB
// entries), that networks without joined endpoints have no sandbox, and that
// the sandbox directory holds no namespace of a network the driver lacks.
// What Leaves handed to the reaper (the veths of endpoints that left, the
// sandbox of a last Leave) is neither missing nor extra while its deletion
// is queued or under way; once it is over, whatever is left is reported.
func (d *Driver) Audit() ([]string, error) {
	var problems []string
	var errs []error
	withSandbox := map[string]bool{}
	d.eachNetwork(func(n *network) {
		// Before anything is read from the kernel (see sandbox.Audit).
		if n.sb != nil || n.tearingDownLocked() {
			withSandbox[n.id] = true
		}
		p, err := d.auditNetworkLocked(n)
		if err != nil {
			errs = append(errs, err)
		}
		for _, s := range p {
			problems = append(problems, fmt.Sprintf("network %s: %s", n.id, s))
		}
	})
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	for _, p := range d.auditEnc() {
		problems = append(problems, "encryption: "+p)
	}
	entries, err := os.ReadDir(d.cfg.NetnsDir)
	if err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("failed to read %s: %w", d.cfg.NetnsDir, err)
	}
	for _, e := range entries {
		if !withSandbox[e.Name()] {
			// Re-check under the lock: the network may have joined meanwhile.
			if n, unlock, err := d.lockNetwork(e.Name()); err == nil {
				has := n.sb != nil || n.tearingDownLocked()
				unlock()
				if has {
					continue
				}
			}
			// A teardown that ended after the directory was read removed it.
			if _, err := os.Lstat(d.host.Path(e.Name())); os.IsNotExist(err) {
				continue
			}
			problems = append(problems, fmt.Sprintf("sandbox %s in %s: no network of this host has a sandbox by that name", e.Name(), d.cfg.NetnsDir))
		}
	}
	return problems, nil
}

// auditNetworkLocked audits n (see Audit).
func (d *Driver) auditNetworkLocked(n *network) ([]string, error) {
	var problems []string
	if n.sb == nil {
		if n.joined != 0 {
			problems = append(problems, fmt.Sprintf("%d endpoints joined but no sandbox", n.joined))
		}
		// A sandbox the reaper is destroying is not extra (asked before
		// the namespace is looked at).
		if !n.tearingDownLocked() && netnsutil.IsNamespace(d.host.Path(n.id)) {
			problems = append(problems, fmt.Sprintf("sandbox namespace %s exists but no endpoint is joined", d.host.Path(n.id)))
		}
		return problems, nil
	}
	if n.joined == 0 {
		problems = append(problems, "sandbox exists but no endpoint is joined")
	}
	p, err := n.sb.Audit(n.peers.Desired(), n.joinedEndpointsLocked(), n.reapingRetiredLocked())
	if err != nil {
		return nil, fmt.Errorf("auditing network %q: %w", n.id, err)
	}
	return append(problems, p...), nil
}

// joinedEndpointsLocked describes the veths of n's joined endpoints for
// its sandbox.
func (n *network) joinedEndpointsLocked() []sandbox.Endpoint {
	var eps []sandbox.Endpoint
	for _, ep := range n.endpoints {
		if ep.joined {
			eps = append(eps, ep.sandboxEndpoint(n.mtu))
		}
	}
	return eps
}
