package driver

import (
	"fmt"
	"strings"

	"github.com/overlayd/overlayd/internal/suggest"
)

// option is one -o key overlayd reads. knownOptions is the one list of
// them: the error for an unknown key and the options table of
// docs/networks.md are made from it, so a key cannot be accepted without
// being documented.
type option struct {
	name    string
	values  string // what it takes
	meaning string
	// internal keys are set by overlayd itself (the swarm leader's
	// AllocateNetwork answer, which dockerd hands to every node's
	// CreateNetwork); they are accepted but not offered to users.
	internal bool
}

var knownOptions = []option{
	{name: OptVNI, values: "N, or N,M,… (1..16777215)",
		meaning: "the network's VXLAN id, one per IPv4 subnet in their order, or one for a network with IPv6 (all its subnets share one segment); required outside swarm and the same on every host (in swarm the leader allocates it)"},
	{name: OptVXLANList, values: "as vni",
		meaning: "the built-in overlay driver's name for vni (give one of the two)"},
	{name: OptEncrypted, values: "no value, true or false",
		meaning: "encrypt the network's traffic between hosts (IPsec ESP)"},
	{name: OptMTUAlias, values: "576..9000",
		meaning: "the MTU of the network's links; at most the underlay device's MTU minus the VXLAN overhead (50 bytes over IPv4, 70 over IPv6) and, when encrypted, the ESP overhead (1416 on a 1500-byte IPv4 underlay); at least 1280 on a network with IPv6; default: that maximum"},
	{name: OptMTU, values: "576..9000",
		meaning: "Docker's name for mtu (give one of the two)"},
	{name: OptExplicitSubnet, values: "no value, true or false",
		meaning: "accept a --subnet that looks like one of dockerd's default pools (172.17.0.0/16 … 172.31.0.0/16, 192.168.N.0/20): say so when you gave it on purpose, the same on every host"},
	{name: OptSeeds, values: "host:port,…", internal: true,
		meaning: "internal: the gossip addresses the swarm leader adds to its AllocateNetwork answer so that every node finds the cluster; never set it by hand"},
}

// dockerFlags are `docker network create` flags users sometimes pass as
// -o options, which then reach no one.
var dockerFlags = map[string]string{
	"subnet":     "--subnet",
	"gateway":    "--gateway",
	"ip-range":   "--ip-range",
	"internal":   "--internal",
	"ipv6":       "--ipv6",
	"attachable": "--attachable",
	"scope":      "--scope",
}

func isKnownOption(key string) bool {
	for _, o := range knownOptions {
		if o.name == key {
			return true
		}
	}
	return false
}

// checkOptionKeys refuses every -o key overlayd does not know, each with a
// did-you-mean when it is close to a known one, and lists the known keys:
// an ignored typo (-o encrypt) would silently give another network than
// the one asked for.
func checkOptionKeys(opts map[string]string) error {
	var bad []string
	for _, k := range sortedKeys(opts) {
		if isKnownOption(k) {
			continue
		}
		switch flag, isFlag := dockerFlags[strings.ToLower(k)]; {
		case isFlag:
			bad = append(bad, fmt.Sprintf("unknown option %q (it is a flag: use docker network create %s)", k, flag))
		case suggestOption(k) != "":
			bad = append(bad, fmt.Sprintf("unknown option %q (did you mean %q?)", k, suggestOption(k)))
		default:
			bad = append(bad, fmt.Sprintf("unknown option %q", k))
		}
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("%s: overlayd's options are %s", strings.Join(bad, "; "), userOptionNames())
}

// userOptionNames lists the keys users may set, in the table's order.
func userOptionNames() string {
	var names []string
	for _, o := range knownOptions {
		if !o.internal {
			names = append(names, o.name)
		}
	}
	return strings.Join(names, ", ")
}

// suggestOption returns the user option closest to key when it is close
// enough to be a typo of it (see suggest.Closest); "" if none is.
func suggestOption(key string) string {
	var names []string
	for _, o := range knownOptions {
		if !o.internal {
			names = append(names, o.name)
		}
	}
	return suggest.Closest(key, names)
}

// optionsMarkdown renders knownOptions as the table of docs/networks.md.
func optionsMarkdown() string {
	var b strings.Builder
	b.WriteString("| Option | Values | Meaning |\n|---|---|---|\n")
	for _, o := range knownOptions {
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", o.name, o.values, o.meaning)
	}
	return b.String()
}
