package daemon

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
)

// StatusReport is what `overlayd status` shows: the control plane's view
// (this node, members) and the driver's (networks, endpoints, peers).
type StatusReport struct {
	Cluster *cluster.Status   `json:"cluster,omitempty"`
	Keys    map[string]string `json:"member_keys,omitempty"` // key epochs each member advertises
	Driver  driver.Status     `json:"driver"`
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
	if len(r.Keys) > 0 {
		fmt.Fprintf(w, "\nKey epochs advertised:\n")
		for _, name := range sortedNames(r.Keys) {
			fmt.Fprintf(w, "  %-20s %s\n", name, r.Keys[name])
		}
	}
	d := r.Driver
	if e := d.Encryption; e != nil {
		fmt.Fprintf(w, "\nEncryption: accept %v, send %d, target %d, generation %016x; encrypted VNIs %v, clear VNIs %v; repairs %d\n",
			e.Accept, e.Send, e.Target, e.Gen, e.EncryptedVNIs, e.ClearVNIs, e.Repairs)
		for _, p := range e.Pairs {
			in := []string{}
			for _, sa := range p.Inbound {
				in = append(in, fmt.Sprintf("epoch %d spi %#08x installed=%v packets=%d", sa.Epoch, sa.SPI, sa.Installed, sa.Packets))
			}
			fmt.Fprintf(w, "  with %-15s (gen %016x, %d networks) send epoch %d (spi %#08x installed=%v packets=%d) policy=%v; inbound: %s\n",
				p.Remote, p.RemoteGen, p.Shares, p.SendEpoch, p.SendSA.SPI, p.SendSA.Installed, p.SendSA.Packets, p.PolicyFound, strings.Join(in, "; "))
		}
		if e.Error != "" {
			fmt.Fprintf(w, "  error: %s\n", e.Error)
		} else if e.LastError != "" {
			fmt.Fprintf(w, "  last error (%s): %s\n", e.LastErrorAt.Format(time.RFC3339), e.LastError)
		}
	}
	fmt.Fprintf(w, "\nDriver: scope %s, VXLAN port %d, VTEP %s (%s)\n", d.Scope, d.VXLANPort, d.AdvertiseAddr, d.VTEPSource)
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
		if len(n.Conflicts) > 0 || n.ConflictsSeen > 0 {
			fmt.Fprintf(w, "  address conflicts: %d now, %d across hosts since the start (see the WARN log lines)\n", len(n.Conflicts), n.ConflictsSeen)
		}
		for _, r := range n.Rejected {
			fmt.Fprintf(w, "  refused record vni %d from %s endpoint %s: %s\n", r.VNI, r.Origin, short(r.EndpointID), r.Reason)
		}
		for _, c := range n.DefinitionConflicts {
			fmt.Fprintf(w, "  definition contradicted: vni %d on host %s (VTEP %s): %s; its %d record(s) refused\n",
				c.VNI, c.Host, c.VTEP, strings.Join(c.Differences, "; "), c.RefusedRecords)
		}
		if n.Error != "" {
			fmt.Fprintf(w, "  error: %s\n", n.Error)
		}
	}
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

func sortedNames(m map[string]string) []string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}
