package daemon

import (
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
)

// StatusReport is what `overlayd status` shows: the control plane's view
// (this node, members) and the driver's (networks, endpoints, peers).
type StatusReport struct {
	Cluster *cluster.Status `json:"cluster,omitempty"`
	Driver  driver.Status   `json:"driver"`
}

// Render writes r for humans.
func (r *StatusReport) Render(w io.Writer) {
	if c := r.Cluster; c != nil {
		n := c.Node
		fmt.Fprintf(w, "Node %s: gossip %s:%d (advertised %s:%d), VTEP %s, key %s, label %q\n",
			n.Name, n.BindAddr, n.BindPort, n.AdvertiseAddr, n.AdvertisePort, n.VTEP, n.KeyFingerprint, n.Label)
		fmt.Fprintf(w, "\nMembers (%d):\n", len(c.Members))
		for _, m := range c.Members {
			self := ""
			if m.Self {
				self = " (this node)"
			}
			fmt.Fprintf(w, "  %-20s %-8s %s:%d  VTEP %-15s records %d%s\n", m.Name, m.State, m.Addr, m.Port, m.VTEP, m.Records, self)
		}
		var drops []string
		for reason, count := range c.Dropped {
			if count > 0 {
				drops = append(drops, fmt.Sprintf("%s=%d", reason, count))
			}
		}
		sort.Strings(drops)
		if len(drops) > 0 {
			fmt.Fprintf(w, "\nDropped gossip: %s\n", strings.Join(drops, " "))
		}
	}
	d := r.Driver
	fmt.Fprintf(w, "\nDriver: scope %s, VXLAN port %d, advertise %s\n", d.Scope, d.VXLANPort, d.AdvertiseAddr)
	if len(d.Networks) == 0 {
		fmt.Fprintf(w, "  no networks\n")
	}
	for _, n := range d.Networks {
		fmt.Fprintf(w, "\nNetwork %s  VNIs %v  subnets %s  MTU %d", n.ID, n.VNIs, strings.Join(n.Subnets, ","), n.MTU)
		if n.Internal {
			fmt.Fprintf(w, "  internal")
		}
		fmt.Fprintln(w)
		for _, ep := range n.Endpoints {
			state := "created"
			if ep.Joined {
				state = "joined"
			}
			fmt.Fprintf(w, "  local  %-18s %s  %-7s %s\n", ep.Address, ep.MAC, state, short(ep.ID))
		}
		for _, p := range n.RemotePeers {
			state := "active"
			if !p.Active {
				state = "shadowed"
			}
			fmt.Fprintf(w, "  remote %-18s %s  via %-15s %-8s %s\n", p.IP, p.MAC, p.VTEP, state, short(p.EndpointID))
		}
		for _, c := range n.Conflicts {
			fmt.Fprintf(w, "  conflict on %s: %s wins over %s\n", c.IP, short(c.Active), strings.Join(c.Shadowed, ","))
		}
	}
	if len(d.PendingPeers) > 0 {
		fmt.Fprintf(w, "\nPeers waiting for networks this host does not have: %v (by VNI)\n", d.PendingPeers)
	}
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
