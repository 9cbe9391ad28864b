// Package config reads overlayd's settings from command-line flags, each with
// an environment equivalent (the managed plugin sets environment variables).
// A flag given on the command line wins over its environment variable.
package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/suggest"
)

// Settings are the daemon's settings after parsing and validation.
type Settings struct {
	Socket        string
	StateDir      string
	Scope         string
	AdvertiseAddr netip.Addr // invalid: learn it
	VXLANPort     int
	NetnsDir      string
	LogLevel      slog.Level
	// Control plane.
	GossipAddr    netip.Addr // invalid: the advertise address
	GossipPort    int
	Join          []string // host[:port] seeds
	SecretFile    string   // "": <state-dir>/cluster.key, generated on first start
	ControlSocket string
	NodeName      string
	// GossipProfile: the failure detector's timings (--gossip-profile).
	GossipProfile cluster.Profile
	// KeyRotationInterval is how often the encryption keys rotate (0: never
	// by timer; `overlayd keys rotate` still works).
	KeyRotationInterval time.Duration
	// MetricsAddr is where /metrics, /healthz and /readyz are served
	// ("host:port"); "" serves none (the default: opt-in).
	MetricsAddr string
	// Names across hosts (docs/names.md). DNSAddress is the name server's
	// address in every sandbox and on the host's loopback; invalid: names
	// are off (--dns-address off). EngineSocket is the local engine's API,
	// read for the names of containers; ResolvConf names the resolvers
	// other names are forwarded to.
	DNSAddress   netip.Addr
	EngineSocket string
	ResolvConf   string
	// Networks defined once (docs/networks.md): NetSync replicates the
	// overlayd networks created on any host's engine to every host's;
	// DriverName is the local engine's name of overlayd's driver ("":
	// found out from the engine).
	NetSync    bool
	DriverName string

	// sources says where each setting's value came from ("--flag" or
	// "$OVERLAYD_..."), so that a refusal names what the user wrote.
	sources map[string]string
}

// Invalid marks an error as a refusal of the settings (the process exits
// with status 2): a value that is malformed, or that does not fit this
// host. Its message names the setting as the user gave it (flag or
// environment variable), the value, what is wrong and what is allowed.
type Invalid struct{ Err error }

func (e *Invalid) Error() string { return e.Err.Error() }
func (e *Invalid) Unwrap() error { return e.Err }

// Source returns how setting name (its flag without dashes) was given:
// "--name" on the command line, "$OVERLAYD_..." from the environment, or
// "--name" for a default.
func (s *Settings) Source(name string) string {
	if src, ok := s.sources[name]; ok {
		return src
	}
	return "--" + name
}

// Defaults.
const (
	DefaultSocket   = "/run/docker/plugins/overlayd.sock"
	DefaultStateDir = "/var/lib/overlayd"
	// DefaultGossipPort is overlayd's memberlist port (TCP and UDP); not
	// 7946, which swarm's gossip uses.
	DefaultGossipPort    = 7947
	DefaultControlSocket = "/run/overlayd/control.sock"
	// DefaultDNSAddress is link-local: never a network's subnet, never
	// routed off the host.
	DefaultDNSAddress   = "169.254.53.53"
	DefaultEngineSocket = "/var/run/docker.sock"
	DefaultResolvConf   = "/etc/resolv.conf"
)

// setting describes one flag and its environment variable.
type setting struct {
	flag, env, def, usage string
}

var settings = []setting{
	{"socket", "OVERLAYD_SOCKET", DefaultSocket, "plugin socket that dockerd connects to (created with mode 0660)"},
	{"state-dir", "OVERLAYD_STATE_DIR", DefaultStateDir, "directory for overlayd's persistent state"},
	{"scope", "OVERLAYD_SCOPE", "local", "driver scope announced to dockerd: local (standalone engines) or global (swarm)"},
	{"advertise-addr", "OVERLAYD_ADVERTISE_ADDR", "", "local VTEP address; default: learned from swarm (DiscoverNew), else the default route's device address"},
	{"vxlan-port", "OVERLAYD_VXLAN_PORT", strconv.Itoa(sandbox.DefaultVXLANPort), "VXLAN UDP port (not 4789, which Docker's own overlay uses)"},
	{"netns-dir", "OVERLAYD_NETNS_DIR", sandbox.DefaultNetnsDir, "directory where network sandbox namespaces are mounted"},
	{"log-level", "OVERLAYD_LOG_LEVEL", "info", "log level: debug, info, warn or error"},
	{"gossip-addr", "OVERLAYD_GOSSIP_ADDR", "", "address the gossip (memberlist) binds to; default: the advertise address"},
	{"gossip-port", "OVERLAYD_GOSSIP_PORT", strconv.Itoa(DefaultGossipPort), "gossip port, TCP and UDP (not 7946, which swarm uses)"},
	{"join", "OVERLAYD_JOIN", "", "comma-separated host[:port] of other overlayd hosts to join (retried in the background)"},
	{"secret-file", "OVERLAYD_SECRET_FILE", "", "file holding the cluster key, mode 0600 or 0400; when given it must exist; default: <state-dir>/cluster.key, generated on first start"},
	{"control-socket", "OVERLAYD_CONTROL_SOCKET", DefaultControlSocket, "local control socket for `overlayd status` (mode 0600)"},
	{"node-name", "OVERLAYD_NODE_NAME", "", "this host's name in the cluster; default: the hostname"},
	{"gossip-profile", "OVERLAYD_GOSSIP_PROFILE", "lan", "gossip timings: lan (one site: detects a dead host in 2-5 s), wan (racks, zones, sites: tolerates loss and 100 ms+ round trips, detects in 6-10 s), or explicit, like wan,probe-timeout=800ms (keys: probe-interval, probe-timeout, suspicion-mult, suspicion-max-mult, gossip-interval, push-pull-interval)"},
	{"key-rotation-interval", "OVERLAYD_KEY_ROTATION_INTERVAL", "12h", "how often encrypted networks' keys rotate cluster-wide (0: only by `overlayd keys rotate`)"},
	{"metrics-addr", "OVERLAYD_METRICS_ADDR", "", "IP:port serving Prometheus /metrics, /healthz and /readyz over HTTP (like 127.0.0.1:9447); default: not served"},
	{"dns-address", "OVERLAYD_DNS_ADDRESS", DefaultDNSAddress, "IPv4 address of the name server that answers containers the names of other hosts' containers (list it first in daemon.json's \"dns\"; docs/names.md), or off"},
	{"engine-socket", "OVERLAYD_ENGINE_SOCKET", DefaultEngineSocket, "the local Docker Engine's API socket, read for the names of containers (not needed with --dns-address off)"},
	{"resolv-conf", "OVERLAYD_RESOLV_CONF", DefaultResolvConf, "resolv.conf whose nameservers get the queries for every other name (re-read when it changes)"},
	{"netsync", "OVERLAYD_NETSYNC", "on", "networks defined once: an overlayd network created on any host's engine is created on every host's, and removed everywhere when removed on one (docs/networks.md); on or off"},
	{"driver-name", "OVERLAYD_DRIVER_NAME", "", "the local engine's name of overlayd's network driver, for the networks netsync creates; default: the enabled managed plugin serving overlayd.sock if there is one, else the plugin socket's name (overlayd)"},
}

// Usage writes the commands and the settings table (flag, environment
// variable, default).
func Usage(w io.Writer, prog string) {
	fmt.Fprintf(w, "Usage: %s [serve] [flags]        serve the plugin API (the default)\n", prog)
	fmt.Fprintf(w, "       %s status [--json]       show the running daemon's view (via --control-socket)\n", prog)
	fmt.Fprintf(w, "       %s keys rotate           start a cluster-wide rotation of the encryption keys\n", prog)
	fmt.Fprintf(w, "       %s leave                 decommission this host: leave the cluster (stopping does not)\n", prog)
	fmt.Fprintf(w, "       %s ipam reclaim NODE     take over the address space of NODE, a host gone for good\n", prog)
	fmt.Fprintf(w, "       %s version               print the version (also --version)\n", prog)
	fmt.Fprintf(w, "       %s help [COMMAND]        this text, or a command's (also COMMAND --help)\n\n", prog)
	fmt.Fprintf(w, "overlayd is a Docker network plugin joining containers on many hosts over VXLAN.\nWith no command it serves the plugin API.\n\n")
	writeFlags(w, settings)
}

// writeFlags writes a flags table: flag, environment variable, usage and
// default, the same for the daemon and the client commands.
func writeFlags(w io.Writer, list []setting) {
	fmt.Fprintf(w, "Flags (each also read from its environment variable; the flag wins):\n")
	for _, s := range list {
		def := s.def
		if def == "" {
			def = "(none)"
		}
		env := "(flag only)"
		if s.env != "" {
			env = "$" + s.env
		}
		fmt.Fprintf(w, "  --%-16s %-26s %s\n  %-44s default %s\n", s.flag, env, s.usage, "", def)
	}
}

// Client commands: they talk to a running daemon through its control
// socket.
var (
	controlSocketFlag = setting{"control-socket", "OVERLAYD_CONTROL_SOCKET", DefaultControlSocket,
		"control socket of the running overlayd; for the managed plugin: /run/docker/plugins/<plugin id>/control.sock"}
	commands = map[string]struct {
		synopsis, about string
		flags           []setting
	}{
		"status": {"status [--json] [--control-socket PATH]",
			"Shows the running daemon's view: this node, the cluster's members (a failed member's records\n" +
				"are marked stale while they stay in force for its return), the encryption state, and each\n" +
				"network by VNI with its local endpoints and remote peers.",
			[]setting{{"json", "", "false", "print the daemon's JSON answer instead of text"}, controlSocketFlag}},
		"keys": {"keys rotate [--control-socket PATH]",
			"Starts a cluster-wide rotation of the encryption keys: every host accepts the new epoch,\n" +
				"then sends with it, then retires the old one. Exits 1 when the rotation cannot start\n" +
				"(no control plane yet, this host left the cluster, keys not established yet).",
			[]setting{controlSocketFlag}},
		"leave": {"leave [--control-socket PATH]",
			"Decommissions this host: it leaves the cluster and the other hosts remove its records at\n" +
				"once. Stopping overlayd does not leave (the others keep its peers through a restart).\n" +
				"Stop overlayd (or disable the plugin) afterwards.",
			[]setting{controlSocketFlag}},
		"ipam": {"ipam reclaim NODE [--control-socket PATH]",
			"Makes this host the owner of every address range of NODE, a host that is gone for good\n" +
				"(decommissioned, or reinstalled with an empty state directory, which makes it a new\n" +
				"identity), so its free addresses can be handed out again. Refused while a member named\n" +
				"NODE is alive or suspect. Addresses NODE's containers held become free: run it only once\n" +
				"NODE and its containers are gone. NODE's identity is then ignored cluster-wide.",
			[]setting{controlSocketFlag}},
	}
)

// IsCommand reports whether name is a client command with its own usage.
func IsCommand(name string) bool { _, ok := commands[name]; return ok }

// CommandUsage writes a client command's usage in the style of Usage.
func CommandUsage(w io.Writer, prog, name string) {
	c := commands[name]
	fmt.Fprintf(w, "Usage: %s %s\n\n%s\n\n", prog, c.synopsis, c.about)
	writeFlags(w, c.flags)
}

// Parse reads args (without the program name) and the environment through
// getenv. It returns flag.ErrHelp for -h/--help, and an *Invalid whose
// message is one line naming every bad setting otherwise. Checks that
// depend on the host are CheckHost's.
func Parse(args []string, getenv func(string) string) (*Settings, error) {
	fs := flag.NewFlagSet("overlayd", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	vals := map[string]*string{}
	for _, s := range settings {
		vals[s.flag] = fs.String(s.flag, s.def, s.usage)
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		return nil, &Invalid{fmt.Errorf("%v (see overlayd --help)", err)}
	}
	if fs.NArg() > 0 {
		return nil, &Invalid{fmt.Errorf("unexpected argument %q: the commands are status, keys, leave, ipam, version and help (see --help)", fs.Arg(0))}
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	st := &Settings{sources: map[string]string{}}
	get := func(name string) (val, source string) {
		for _, s := range settings {
			if s.flag != name {
				continue
			}
			switch v := getenv(s.env); {
			case given[name]:
				val, source = *vals[name], "--"+name
			case v != "":
				val, source = v, "$"+s.env
			default:
				val, source = s.def, "--"+name
			}
			st.sources[name] = source
			return val, source
		}
		panic("unknown setting " + name)
	}
	var errs []error
	var src string
	st.Socket, src = get("socket")
	if !filepath.IsAbs(st.Socket) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path", src, st.Socket))
	}
	st.StateDir, src = get("state-dir")
	if !filepath.IsAbs(st.StateDir) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path", src, st.StateDir))
	}
	st.Scope, src = get("scope")
	if st.Scope != "local" && st.Scope != "global" {
		errs = append(errs, fmt.Errorf("%s %q: must be local or global", src, st.Scope))
	}
	if v, src := get("advertise-addr"); v != "" {
		a, err := netip.ParseAddr(v)
		if err != nil || a.IsUnspecified() || a.IsMulticast() {
			errs = append(errs, fmt.Errorf("%s %q: must be a unicast IP address of this host", src, v))
		}
		st.AdvertiseAddr = a.Unmap()
	}
	if v, src := get("vxlan-port"); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 1 || p > 65535 {
			errs = append(errs, fmt.Errorf("%s %q: must be a UDP port number in 1..65535", src, v))
		}
		st.VXLANPort = p
	}
	st.NetnsDir, src = get("netns-dir")
	if !filepath.IsAbs(st.NetnsDir) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path", src, st.NetnsDir))
	}
	lvl, src := get("log-level")
	if err := st.LogLevel.UnmarshalText([]byte(strings.ToLower(lvl))); err != nil {
		errs = append(errs, fmt.Errorf("%s %q: must be debug, info, warn or error", src, lvl))
	}
	if v, src := get("gossip-addr"); v != "" {
		a, err := netip.ParseAddr(v)
		if err != nil || a.IsMulticast() {
			errs = append(errs, fmt.Errorf("%s %q: must be an IP address of this host", src, v))
		}
		st.GossipAddr = a.Unmap()
	}
	if v, src := get("gossip-port"); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 1 || p > 65535 {
			errs = append(errs, fmt.Errorf("%s %q: must be a port number in 1..65535", src, v))
		}
		st.GossipPort = p
	}
	if v, src := get("join"); v != "" {
		for _, seed := range strings.Split(v, ",") {
			seed = strings.TrimSpace(seed)
			if seed == "" {
				continue
			}
			if err := checkSeed(seed); err != nil {
				errs = append(errs, fmt.Errorf("%s %q: %v", src, seed, err))
				continue
			}
			st.Join = append(st.Join, seed)
		}
	}
	st.SecretFile, src = get("secret-file")
	if st.SecretFile != "" && !filepath.IsAbs(st.SecretFile) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path", src, st.SecretFile))
	}
	st.ControlSocket, src = get("control-socket")
	if !filepath.IsAbs(st.ControlSocket) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path", src, st.ControlSocket))
	}
	st.NodeName, src = get("node-name")
	if st.NodeName == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			errs = append(errs, fmt.Errorf("--node-name: not given and the hostname is unknown (%v)", err))
		}
		st.NodeName = h
	} else if len(st.NodeName) > 128 || strings.ContainsAny(st.NodeName, " \t\n/") {
		errs = append(errs, fmt.Errorf("%s %q: must be at most 128 characters without spaces or slashes", src, st.NodeName))
	}
	if v, src := get("gossip-profile"); v != "" {
		p, err := cluster.ParseProfile(v)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %q: %v; allowed: %s", src, v, err, cluster.ProfileSyntax))
		}
		st.GossipProfile = p
	}
	if v, src := get("key-rotation-interval"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 || (d > 0 && d < time.Minute) {
			errs = append(errs, fmt.Errorf("%s %q: must be a duration of at least 1m (like 12h), or 0 to rotate only on request", src, v))
		}
		st.KeyRotationInterval = d
	}
	if v, src := get("metrics-addr"); v != "" {
		if err := checkListenAddr(v); err != nil {
			errs = append(errs, fmt.Errorf("%s %q: %v", src, v, err))
		}
		st.MetricsAddr = v
	}
	if v, src := get("dns-address"); v != "off" {
		a, err := netip.ParseAddr(v)
		if err != nil || !a.Is4() || a.IsUnspecified() || a.IsMulticast() || a.IsLoopback() || a == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
			errs = append(errs, fmt.Errorf("%s %q: must be a unicast IPv4 address that is not loopback (the default %s is link-local, never routed), or off", src, v, DefaultDNSAddress))
		}
		st.DNSAddress = a
	}
	st.EngineSocket, src = get("engine-socket")
	if !filepath.IsAbs(st.EngineSocket) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path of the engine's unix socket", src, st.EngineSocket))
	}
	st.ResolvConf, src = get("resolv-conf")
	if !filepath.IsAbs(st.ResolvConf) {
		errs = append(errs, fmt.Errorf("%s %q: must be an absolute path", src, st.ResolvConf))
	}
	switch v, src := get("netsync"); v {
	case "on":
		st.NetSync = true
	case "off":
	default:
		errs = append(errs, fmt.Errorf("%s %q: must be on or off", src, v))
	}
	if v, src := get("driver-name"); v != "" {
		if strings.ContainsAny(v, " \t\n") || len(v) > 255 {
			errs = append(errs, fmt.Errorf("%s %q: must be a plugin name as docker network ls shows it (overlayd, overlayd:latest, example/overlayd:1.2), at most 255 bytes without spaces", src, v))
		}
		st.DriverName = v
	}
	if len(errs) > 0 {
		return nil, &Invalid{oneLine(errs)}
	}
	return st, nil
}

// checkListenAddr validates "IP:port" for a TCP listener: the IP literal
// (no host name: what it resolves to could change under a running daemon;
// empty or 0.0.0.0 means every address) and a port in 1..65535 (0 would
// pick one nobody can scrape).
func checkListenAddr(v string) error {
	host, port, err := net.SplitHostPort(v)
	if err != nil {
		return errors.New("must be IP:port, like 127.0.0.1:9447 or [::1]:9447")
	}
	if host != "" {
		if _, err := netip.ParseAddr(host); err != nil {
			return fmt.Errorf("%q is not an IP address: must be IP:port, like 127.0.0.1:9447", host)
		}
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("port %q is not in 1..65535", port)
	}
	return nil
}

// oneLine joins errors into one line: a managed plugin's output reaches
// dockerd's log line by line, and one refusal must stay one line there.
func oneLine(errs []error) error {
	msgs := make([]string, len(errs))
	for i, e := range errs {
		msgs[i] = e.Error()
	}
	return errors.New(strings.Join(msgs, "; "))
}

// checkSeed validates "host[:port]".
func checkSeed(seed string) error {
	host, port := seed, ""
	if h, p, err := net.SplitHostPort(seed); err == nil {
		host, port = h, p
	}
	if host == "" {
		return errors.New("empty host: use host or host:port")
	}
	if port != "" {
		if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
			return fmt.Errorf("port %q is not in 1..65535", port)
		}
	}
	return nil
}

// SecretPath returns the cluster key file: --secret-file, or the default in
// the state directory.
func (s *Settings) SecretPath() string {
	if s.SecretFile != "" {
		return s.SecretFile
	}
	return filepath.Join(s.StateDir, "cluster.key")
}

// Env returns the process environment lookup (for Parse).
func Env(k string) string { return os.Getenv(k) }

// EnvPrefix begins the name of every environment variable overlayd reads.
const EnvPrefix = "OVERLAYD_"

// UnknownEnv returns a warning for each variable of environ (as os.Environ
// gives it) that begins with EnvPrefix but is no setting of overlayd, with
// the setting it was probably meant to be. A misspelt variable would
// otherwise be ignored without a word, and the setting silently take its
// default. These are warnings, not refusals: the variables of overlayd's
// own test suites, inherited by the daemons they start, share the prefix.
func UnknownEnv(environ []string) []string {
	known := make([]string, len(settings))
	for i, s := range settings {
		known[i] = s.env
	}
	var out []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, EnvPrefix) || slices.Contains(known, name) {
			continue
		}
		msg := fmt.Sprintf("environment variable %s is not a setting of overlayd and is ignored", name)
		if s := suggest.Closest(name, known); s != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", s)
		}
		out = append(out, msg+"; overlayd --help lists the settings")
	}
	return out
}
