package cluster

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
)

// Profile is a set of failure-detector and gossip timings. The trade-off
// is detection time against false dead detections: a probe must outlast
// the underlay's round trip and a few losses, and a suspect must have time
// to hear of its suspicion and refute it, which on a lossy, distant
// underlay takes longer. Both profiles keep memberlist's Lifeguard
// extensions on (awareness: a node that misses acks stretches its own
// probe timeouts, up to 8 times; suspicion timeouts shrink as independent
// confirmations arrive), so a slow host suspects others less readily.
type Profile struct {
	// Name is the base: "lan" (memberlist's DefaultLANConfig) or "wan"
	// (DefaultWANConfig); "" is "lan".
	Name                    string
	ProbeInterval           time.Duration
	ProbeTimeout            time.Duration
	SuspicionMult           int
	SuspicionMaxTimeoutMult int
	GossipInterval          time.Duration
	PushPullInterval        time.Duration
	TCPTimeout              time.Duration
}

// LANProfile is for hosts of one site (sub-millisecond round trips, no
// loss to speak of): a dead host is detected in about 2-3.5 s with 50
// hosts (under 5 s in the worst case measured); a suspect has at least
// 0.9 s (3 hosts) to 1.5 s (50 hosts) to refute. It takes false deaths
// on an underlay that loses packets or has round trips near the 150 ms
// probe timeout.
var LANProfile = Profile{
	Name:                    "lan",
	ProbeInterval:           DefaultProbeInterval,
	ProbeTimeout:            DefaultProbeTimeout,
	SuspicionMult:           DefaultSuspicionMult,
	SuspicionMaxTimeoutMult: DefaultSuspicionMaxTimeoutMult,
	GossipInterval:          DefaultGossipInterval,
	PushPullInterval:        DefaultPushPullInterval,
	TCPTimeout:              DefaultTCPTimeout,
}

// WANProfile is for hosts across racks, zones or sites: round trips up
// to a few hundred milliseconds and a few percent loss. memberlist's own
// WAN timings (probe every 5 s, suspicion 30 s to 2 min) would leave a
// dead host's containers unreachable for minutes; these detect a killed
// host in about 6-10 s with 6 hosts (suspicion at least 4 s, times
// log10 of the cluster size beyond 10 hosts) and measured no false
// detection in 10 minutes at 10% loss and 100 ms round trip.
var WANProfile = Profile{
	Name:                    "wan",
	ProbeInterval:           time.Second,
	ProbeTimeout:            500 * time.Millisecond, // 5 round trips of 100 ms
	SuspicionMult:           4,
	SuspicionMaxTimeoutMult: 4,
	GossipInterval:          200 * time.Millisecond,
	PushPullInterval:        15 * time.Second,
	TCPTimeout:              10 * time.Second,
}

// profileKeys are the explicit timings ParseProfile accepts, in the order
// of the help text.
var profileKeys = []string{"probe-interval", "probe-timeout", "suspicion-mult", "suspicion-max-mult", "gossip-interval", "push-pull-interval"}

// ProfileSyntax describes what ParseProfile accepts (for refusals and help).
const ProfileSyntax = "lan, wan, or timings like wan,probe-timeout=800ms (keys: probe-interval, probe-timeout, suspicion-mult, suspicion-max-mult, gossip-interval, push-pull-interval)"

// ParseProfile parses "lan", "wan" or explicit timings: comma-separated
// key=value pairs, optionally after a base ("wan,probe-timeout=800ms");
// without a base the others are lan's. The result is validated; the error
// names the key, the value and what is allowed.
func ParseProfile(s string) (Profile, error) {
	parts := strings.Split(strings.TrimSpace(s), ",")
	p := LANProfile
	switch strings.TrimSpace(parts[0]) {
	case "lan", "":
		parts = parts[1:]
	case "wan":
		p, parts = WANProfile, parts[1:]
	default:
		if !strings.Contains(parts[0], "=") {
			return Profile{}, fmt.Errorf("unknown profile %q: the profiles are lan and wan", parts[0])
		}
	}
	seen := map[string]bool{}
	for _, kv := range parts {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return Profile{}, fmt.Errorf("%q is not key=value (keys: %s)", kv, strings.Join(profileKeys, ", "))
		}
		if !slices.Contains(profileKeys, k) {
			return Profile{}, fmt.Errorf("unknown timing %q (keys: %s)", k, strings.Join(profileKeys, ", "))
		}
		if seen[k] {
			return Profile{}, fmt.Errorf("timing %s given twice", k)
		}
		seen[k] = true
		var err error
		durations := map[string]*time.Duration{"probe-interval": &p.ProbeInterval, "probe-timeout": &p.ProbeTimeout,
			"gossip-interval": &p.GossipInterval, "push-pull-interval": &p.PushPullInterval}
		counts := map[string]*int{"suspicion-mult": &p.SuspicionMult, "suspicion-max-mult": &p.SuspicionMaxTimeoutMult}
		if d := durations[k]; d != nil {
			*d, err = time.ParseDuration(v)
		} else {
			*counts[k], err = strconv.Atoi(v)
		}
		if err != nil {
			what := "a duration like 500ms"
			if strings.HasSuffix(k, "-mult") {
				what = "a whole number"
			}
			return Profile{}, fmt.Errorf("%s %q: must be %s", k, v, what)
		}
	}
	if err := p.validate(); err != nil {
		return Profile{}, err
	}
	return p, nil
}

// validate checks the timings, naming the key as ParseProfile spells it.
func (p Profile) validate() error {
	if p.Name != "lan" && p.Name != "wan" {
		return fmt.Errorf("unknown profile %q: the profiles are lan and wan", p.Name)
	}
	durations := []struct {
		key      string
		v        time.Duration
		min, max time.Duration
	}{
		{"probe-interval", p.ProbeInterval, 100 * time.Millisecond, time.Minute},
		{"probe-timeout", p.ProbeTimeout, 10 * time.Millisecond, time.Minute},
		{"gossip-interval", p.GossipInterval, 10 * time.Millisecond, 10 * time.Second},
		{"push-pull-interval", p.PushPullInterval, time.Second, time.Hour},
	}
	for _, d := range durations {
		if d.v < d.min || d.v > d.max {
			return fmt.Errorf("%s %v: must be from %v to %v", d.key, d.v, d.min, d.max)
		}
	}
	if p.ProbeTimeout >= p.ProbeInterval {
		return fmt.Errorf("probe-timeout %v: must be shorter than probe-interval (%v): a probe (direct, then indirect) must end within its interval", p.ProbeTimeout, p.ProbeInterval)
	}
	for _, m := range []struct {
		key string
		v   int
	}{{"suspicion-mult", p.SuspicionMult}, {"suspicion-max-mult", p.SuspicionMaxTimeoutMult}} {
		if m.v < 1 || m.v > 20 {
			return fmt.Errorf("%s %d: must be from 1 to 20", m.key, m.v)
		}
	}
	if p.TCPTimeout <= 0 {
		return fmt.Errorf("TCP timeout %v: must be positive", p.TCPTimeout)
	}
	return nil
}

// String is the profile as ParseProfile reads it: the base, then every
// timing that differs from it.
func (p Profile) String() string {
	base := LANProfile
	if p.Name == "wan" {
		base = WANProfile
	}
	out := []string{base.Name}
	add := func(k string, v, b any) {
		if v != b {
			out = append(out, fmt.Sprintf("%s=%v", k, v))
		}
	}
	add("probe-interval", p.ProbeInterval, base.ProbeInterval)
	add("probe-timeout", p.ProbeTimeout, base.ProbeTimeout)
	add("suspicion-mult", p.SuspicionMult, base.SuspicionMult)
	add("suspicion-max-mult", p.SuspicionMaxTimeoutMult, base.SuspicionMaxTimeoutMult)
	add("gossip-interval", p.GossipInterval, base.GossipInterval)
	add("push-pull-interval", p.PushPullInterval, base.PushPullInterval)
	return strings.Join(out, ",")
}

// baseMemberlistConfig is memberlist's own configuration the profile
// builds on: its WAN config for "wan" (longer dead-node gossip, among
// others), its LAN config otherwise.
func (p Profile) baseMemberlistConfig() *memberlist.Config {
	if p.Name == "wan" {
		return memberlist.DefaultWANConfig()
	}
	return memberlist.DefaultLANConfig()
}
