package daemon

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/ipam"
	"github.com/overlayd/overlayd/internal/netsync"
)

// StatusReport is what `overlayd status` shows: the control plane's view
// (this node, members) and the driver's (networks, endpoints, peers).
type StatusReport struct {
	// Ready is what /readyz answers: "ready", or "not ready: " and why.
	Ready   string            `json:"ready"`
	Cluster *cluster.Status   `json:"cluster,omitempty"`
	Keys    map[string]string `json:"member_keys,omitempty"` // key epochs each member advertises
	Driver  driver.Status     `json:"driver"`
	// IPAM is the cluster address management's view: per pool, the
	// ranges this host owns and the cluster's totals.
	IPAM *ipam.Status `json:"ipam,omitempty"`
	// Names: the names served across hosts (nil when off).
	Names *NamesStatus `json:"names,omitempty"`
	// NetSync: networks defined once (nil when off or not started).
	NetSync *netsync.Status `json:"netsync,omitempty"`
}

// Render writes r for humans, section by section: this node, the members,
// key epochs, encryption, then the driver and its networks by VNI. A new
// part of the status is a new section (a function below, called here), or
// a block in renderNetwork for something per network.
func (r *StatusReport) Render(w io.Writer) {
	stale := r.staleVTEPs()
	if r.Ready != "" {
		fmt.Fprintf(w, "Readiness: %s\n", r.Ready)
	}
	r.renderNode(w)
	r.renderMembers(w)
	r.renderKeys(w)
	r.renderEncryption(w)
	r.renderIPAM(w)
	r.renderNames(w)
	r.renderNetSync(w)
	r.renderDriver(w, stale)
}

func (r *StatusReport) renderNetSync(w io.Writer) {
	n := r.NetSync
	if n == nil {
		return
	}
	live := n.Live()
	fmt.Fprintf(w, "Networks defined once: %d live, %d removed (driver %s; replicas created %d, removed %d)", live, len(n.Entries)-live, n.Driver, n.Created, n.Removed)
	if n.LastError != "" {
		fmt.Fprintf(w, " (failing: %s)", n.LastError)
	}
	fmt.Fprintln(w)
	for _, e := range n.Entries {
		state := "live"
		if !e.Live {
			state = "removed"
		}
		fmt.Fprintf(w, "  %-24s %-7s by %s at %s\n", e.Name, state, e.Host, e.Time.Format(time.RFC3339))
	}
	for _, c := range n.Conflicts {
		fmt.Fprintf(w, "  conflict: network %s (%s) here differs from the cluster's, left alone: %s\n", c.Name, short(c.ID), strings.Join(c.Diff, "; "))
	}
	for _, k := range n.Kept {
		fmt.Fprintf(w, "  kept: network %s removed in the cluster, used here by %d containers\n", k.Name, k.Endpoints)
	}
	for _, u := range n.Elsewhere {
		fmt.Fprintf(w, "  still used: network %s (removed) on %s by %d containers\n", u.Name, u.Host, u.Containers)
	}
}

func (r *StatusReport) renderNames(w io.Writer) {
	n := r.Names
	if n == nil {
		return
	}
	fmt.Fprintf(w, "Names: %d served at %s, engine %s", n.Names, n.Address, n.Engine)
	if n.EngineErr != "" {
		fmt.Fprintf(w, " (unreadable: %s)", n.EngineErr)
	}
	fmt.Fprintf(w, ", other names forwarded to %s\n", strings.Join(n.Upstreams, ","))
	ids := make([]string, 0, len(n.Networks))
	for id := range n.Networks {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		for _, na := range n.Networks[id] {
			addrs := make([]string, len(na.Addrs))
			for i, a := range na.Addrs {
				addrs[i] = a.String()
			}
			fmt.Fprintf(w, "  network %s  %-24s %s\n", short(id), na.Name, strings.Join(addrs, ","))
		}
	}
	for _, c := range n.Conflicts {
		fmt.Fprintf(w, "  conflict: VNI %d name %s on hosts %s\n", c.VNI, c.Name, strings.Join(c.Hosts, ","))
	}
}

func (r *StatusReport) renderNode(w io.Writer) {
	c := r.Cluster
	if c == nil {
		fmt.Fprintf(w, "Control plane: not started (this host's address, the VTEP, is not known yet; see the log)\n")
		return
	}
	n := c.Node
	fmt.Fprintf(w, "Node %s: gossip %s:%d (advertised %s:%d), VTEP %s, key %s, label %q, records published %d\n",
		n.Name, n.BindAddr, n.BindPort, n.AdvertiseAddr, n.AdvertisePort, n.VTEP, n.KeyFingerprint, n.Label, r.ownRecords())
}

// readiness renders the control plane's readiness as /readyz does.
func readiness(err error) string {
	if err != nil {
		return "not ready: " + err.Error()
	}
	return "ready"
}

// ownRecords is the number of records this node publishes.
func (r *StatusReport) ownRecords() int {
	for _, m := range r.Cluster.Members {
		if m.Self {
			return m.Records
		}
	}
	return 0
}

func (r *StatusReport) renderMembers(w io.Writer) {
	c := r.Cluster
	if c == nil {
		return
	}
	fmt.Fprintf(w, "\nMembers (%d):\n", len(c.Members))
	for _, m := range c.Members {
		note := ""
		switch {
		case m.Self:
			note = " (this node)"
		case isStale(m):
			note = fmt.Sprintf("  stale: kept in force for its return until %s", m.InForceUntil.UTC().Format(time.TimeOnly+" UTC"))
		}
		fmt.Fprintf(w, "  %-20s %-8s %s:%d  VTEP %-15s records %d%s\n", m.Name, m.State, m.Addr, m.Port, m.VTEP, m.Records, note)
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

// isStale reports whether m's records are in force only because of the
// grace after its failure (FailedGrace): they describe containers that may
// be gone.
func isStale(m cluster.MemberStatus) bool {
	return !m.Self && m.State == cluster.StateDead && !m.InForceUntil.IsZero()
}

// staleVTEPs returns the VTEPs of the members whose records are stale.
func (r *StatusReport) staleVTEPs() map[string]bool {
	out := map[string]bool{}
	if r.Cluster == nil {
		return out
	}
	for _, m := range r.Cluster.Members {
		if isStale(m) && m.VTEP.IsValid() {
			out[m.VTEP.String()] = true
		}
	}
	return out
}

func (r *StatusReport) renderKeys(w io.Writer) {
	if len(r.Keys) == 0 {
		return
	}
	fmt.Fprintf(w, "\nKey epochs advertised:\n")
	for _, name := range sortedNames(r.Keys) {
		fmt.Fprintf(w, "  %-20s %s\n", name, r.Keys[name])
	}
}

func (r *StatusReport) renderEncryption(w io.Writer) {
	e := r.Driver.Encryption
	if e == nil {
		return
	}
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
		fmt.Fprintf(w, "  failing: %s\n", e.Error)
	} else if e.LastError != "" {
		fmt.Fprintf(w, "  last failure (%s): %s\n", e.LastErrorAt.Format(time.RFC3339), e.LastError)
	}
}

// renderIPAM writes the address management's pools: this host's ranges
// with their free/used counts, then every owner's share as last reported.
func (r *StatusReport) renderIPAM(w io.Writer) {
	st := r.IPAM
	if st == nil {
		return
	}
	fmt.Fprintf(w, "\nAddress management (--ipam-driver overlayd): host id %s, %d pool(s)\n", st.HostID, len(st.Pools))
	for _, id := range st.Reclaimed {
		fmt.Fprintf(w, "  reclaimed identity %s (its messages are ignored)\n", id)
	}
	if st.DroppedMessages > 0 {
		fmt.Fprintf(w, "  messages dropped on a full queue: %d (the exchanges repeat them)\n", st.DroppedMessages)
	}
	for _, p := range st.Pools {
		fmt.Fprintf(w, "  pool %s  gateway %s  range %s  %d addresses; used by %d network(s) here\n", p.Prefix, p.Gateway, p.Range, p.Size, p.InUse)
		if p.PendingClaim != "" {
			fmt.Fprintf(w, "    pending claim: %s\n", p.PendingClaim)
		}
		fmt.Fprintf(w, "    this host owns %d: %d free, %d used\n", p.LocalOwned, p.LocalFree, p.LocalUsed)
		for _, rg := range p.Ranges {
			fmt.Fprintf(w, "      %s-%s  %d addresses: %d free, %d used\n", rg.First, rg.Last, rg.Size, rg.Free, rg.Used)
		}
		unreported := ""
		if p.Unreported > 0 {
			unreported = fmt.Sprintf(", %d owned by hosts that have not reported", p.Unreported)
		}
		fmt.Fprintf(w, "    cluster: %d free, %d used%s\n", p.ClusterFree, p.ClusterUsed, unreported)
		for _, o := range p.Owners {
			figures := "not reported"
			switch {
			case o.State == "self":
				figures = fmt.Sprintf("%d free, %d used", o.Free, o.Used)
			case o.Reported:
				figures = fmt.Sprintf("%d free, %d used as of %s", o.Free, o.Used, o.Since.UTC().Format(time.TimeOnly+" UTC"))
			}
			fmt.Fprintf(w, "      %-20s %-9s owns %d: %s\n", o.Node, o.State, o.Owned, figures)
		}
		for _, c := range p.Conflicts {
			fmt.Fprintf(w, "    CONFLICT: %s\n", c)
		}
	}
}

func (r *StatusReport) renderDriver(w io.Writer, stale map[string]bool) {
	d := r.Driver
	vtep := d.AdvertiseAddr
	if vtep == "" {
		vtep = "unknown yet"
	}
	fmt.Fprintf(w, "\nDriver: scope %s, VXLAN port %d, VTEP %s (%s)\n", d.Scope, d.VXLANPort, vtep, d.VTEPSource)
	if len(d.Networks) == 0 {
		fmt.Fprintf(w, "  no networks\n")
	}
	nets := slices.Clone(d.Networks)
	slices.SortStableFunc(nets, func(a, b driver.NetworkStatus) int { return cmp.Compare(firstVNI(a), firstVNI(b)) })
	for _, n := range nets {
		renderNetwork(w, n, stale)
	}
}

func firstVNI(n driver.NetworkStatus) uint32 {
	if len(n.VNIs) == 0 {
		return 0
	}
	return slices.Min(n.VNIs)
}

// renderNetwork writes one network, VNI first (the name every host shares;
// the network ID is each engine's own).
func renderNetwork(w io.Writer, n driver.NetworkStatus, stale map[string]bool) {
	vnis := make([]string, len(n.VNIs))
	for i, v := range n.VNIs {
		vnis[i] = fmt.Sprint(v)
	}
	fmt.Fprintf(w, "\nVNI %s  network %s  subnets %s  MTU %d", strings.Join(vnis, ","), short(n.ID), strings.Join(n.Subnets, ","), n.MTU)
	if n.Encrypted {
		fmt.Fprintf(w, "  encrypted")
	}
	if n.Internal {
		fmt.Fprintf(w, "  internal")
	}
	fmt.Fprintln(w)
	for _, ep := range n.Endpoints {
		state := "created"
		if ep.Joined {
			state = "joined"
		}
		fmt.Fprintf(w, "  local  %-18s %s  %-7s %s\n", joinNonEmpty(ep.Address, ep.AddressIPv6), ep.MAC, state, short(ep.ID))
	}
	for _, p := range n.RemotePeers {
		// Each address is a claim of its own: the state is per address.
		var states []string
		if p.IP != "" {
			states = append(states, claimState(p.Active))
		}
		if p.IPv6 != "" {
			states = append(states, claimState(p.ActiveIPv6))
		}
		note := ""
		if stale[p.VTEP] {
			note = "  stale: its host failed, kept for its return"
		}
		fmt.Fprintf(w, "  remote %-18s %s  via %-15s %-8s %s%s\n", joinNonEmpty(p.IP, p.IPv6), p.MAC, p.VTEP, strings.Join(states, ","), short(p.EndpointID), note)
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
		fmt.Fprintf(w, "  failing: %s\n", n.Error)
	}
}

func claimState(active bool) string {
	if active {
		return "active"
	}
	return "shadowed"
}

// joinNonEmpty joins the non-empty strings of s with commas.
func joinNonEmpty(s ...string) string {
	return strings.Join(slices.DeleteFunc(s, func(v string) bool { return v == "" }), ",")
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
