package config

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestDefaults(t *testing.T) {
	st, err := Parse(nil, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	if st.Socket != DefaultSocket || st.StateDir != DefaultStateDir || st.Scope != "local" ||
		st.VXLANPort != 4799 || st.NetnsDir != "/run/overlayd/netns" || st.AdvertiseAddr.IsValid() || st.LogLevel.String() != "INFO" {
		t.Fatalf("defaults: %+v", st)
	}
}

func TestFlagWinsOverEnv(t *testing.T) {
	e := env(map[string]string{
		"OVERLAYD_SOCKET": "/env.sock", "OVERLAYD_SCOPE": "global", "OVERLAYD_VXLAN_PORT": "5000",
		"OVERLAYD_ADVERTISE_ADDR": "192.0.2.7", "OVERLAYD_LOG_LEVEL": "debug", "OVERLAYD_STATE_DIR": "/env/state",
		"OVERLAYD_NETNS_DIR": "/env/netns",
	})
	st, err := Parse(nil, e)
	if err != nil {
		t.Fatal(err)
	}
	if st.Socket != "/env.sock" || st.Scope != "global" || st.VXLANPort != 5000 || st.AdvertiseAddr.String() != "192.0.2.7" ||
		st.LogLevel.String() != "DEBUG" || st.StateDir != "/env/state" || st.NetnsDir != "/env/netns" {
		t.Fatalf("env not used: %+v", st)
	}
	st, err = Parse([]string{"--socket", "/flag.sock", "--scope=local", "--vxlan-port", "6000", "--advertise-addr", "198.51.100.1",
		"--log-level", "warn", "--state-dir", "/flag/state", "--netns-dir", "/flag/netns"}, e)
	if err != nil {
		t.Fatal(err)
	}
	if st.Socket != "/flag.sock" || st.Scope != "local" || st.VXLANPort != 6000 || st.AdvertiseAddr.String() != "198.51.100.1" ||
		st.LogLevel.String() != "WARN" || st.StateDir != "/flag/state" || st.NetnsDir != "/flag/netns" {
		t.Fatalf("flags must win over env: %+v", st)
	}
}

func TestBadSettingsNameTheSetting(t *testing.T) {
	cases := []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--scope", "cluster"}, nil, "--scope \"cluster\": must be local or global"},
		{nil, map[string]string{"OVERLAYD_SCOPE": "x"}, "$OVERLAYD_SCOPE \"x\""},
		{[]string{"--vxlan-port", "0"}, nil, "--vxlan-port \"0\""},
		{[]string{"--vxlan-port", "http"}, nil, "1..65535"},
		{[]string{"--advertise-addr", "host"}, nil, "--advertise-addr \"host\""},
		{[]string{"--advertise-addr", "0.0.0.0"}, nil, "unicast"},
		{[]string{"--socket", "rel.sock"}, nil, "--socket \"rel.sock\": must be an absolute path"},
		{[]string{"--log-level", "loud"}, nil, "--log-level \"loud\""},
		{[]string{"--netns-dir", "x"}, nil, "--netns-dir"},
		{[]string{"--state-dir", "x"}, nil, "--state-dir"},
		{[]string{"--nope"}, nil, "flag provided but not defined"},
		{[]string{"extra"}, nil, "unexpected argument"},
	}
	for _, c := range cases {
		_, err := Parse(c.args, env(c.env))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Parse(%v, %v) = %v, want error containing %q", c.args, c.env, err, c.want)
		}
	}
}

func TestHelpListsEverySetting(t *testing.T) {
	if _, err := Parse([]string{"--help"}, env(nil)); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	var b bytes.Buffer
	Usage(&b, "overlayd")
	for _, s := range settings {
		if !strings.Contains(b.String(), "--"+s.flag) || !strings.Contains(b.String(), s.env) {
			t.Errorf("usage lacks %s / %s", s.flag, s.env)
		}
	}
}

func TestClusterSettings(t *testing.T) {
	st, err := Parse([]string{"--join", "192.0.2.1, 192.0.2.2:7000,[2001:db8::1]:7947", "--gossip-addr", "192.0.2.9", "--node-name", "h1"},
		env(map[string]string{"OVERLAYD_GOSSIP_PORT": "7000", "OVERLAYD_SECRET_FILE": "/etc/overlayd/key"}))
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Join) != 3 || st.Join[1] != "192.0.2.2:7000" || st.GossipPort != 7000 || st.GossipAddr.String() != "192.0.2.9" ||
		st.NodeName != "h1" || st.SecretPath() != "/etc/overlayd/key" || st.ControlSocket != DefaultControlSocket {
		t.Fatalf("cluster settings: %+v", st)
	}
	st, _ = Parse([]string{"--state-dir", "/s"}, env(nil))
	if st.SecretPath() != "/s/cluster.key" || st.GossipPort != 7947 || st.NodeName == "" {
		t.Fatalf("cluster defaults: %+v", st)
	}
	for _, bad := range [][]string{{"--join", "192.0.2.1:99999"}, {"--join", ":7000"}, {"--gossip-port", "x"}, {"--gossip-addr", "h"},
		{"--secret-file", "key"}, {"--control-socket", "c.sock"}, {"--node-name", "a b"}} {
		if _, err := Parse(bad, env(nil)); err == nil || !strings.Contains(err.Error(), bad[0]) {
			t.Errorf("Parse(%v) = %v, want an error naming %s", bad, err, bad[0])
		}
	}
}

func TestKeyRotationInterval(t *testing.T) {
	st, err := Parse(nil, env(nil))
	if err != nil || st.KeyRotationInterval != 12*time.Hour {
		t.Fatalf("default key rotation interval: %v %v", st, err)
	}
	st, err = Parse([]string{"--key-rotation-interval", "0"}, env(nil))
	if err != nil || st.KeyRotationInterval != 0 {
		t.Fatalf("0: %v %v", st, err)
	}
	for _, bad := range []string{"soon", "10s", "-1h"} {
		if _, err := Parse([]string{"--key-rotation-interval", bad}, env(nil)); err == nil || !strings.Contains(err.Error(), "--key-rotation-interval") {
			t.Errorf("--key-rotation-interval %s: %v", bad, err)
		}
	}
}

func TestMetricsAddr(t *testing.T) {
	st, err := Parse(nil, env(nil))
	if err != nil || st.MetricsAddr != "" {
		t.Fatalf("metrics are opt-in: %q %v", st.MetricsAddr, err)
	}
	st, err = Parse(nil, env(map[string]string{"OVERLAYD_METRICS_ADDR": "127.0.0.1:9447"}))
	if err != nil || st.MetricsAddr != "127.0.0.1:9447" {
		t.Fatalf("from the environment: %q %v", st.MetricsAddr, err)
	}
	for _, good := range []string{":9447", "[::1]:9447", "0.0.0.0:1"} {
		if _, err := Parse([]string{"--metrics-addr", good}, env(nil)); err != nil {
			t.Errorf("--metrics-addr %s: %v", good, err)
		}
	}
	for _, bad := range []string{"9447", "localhost:9447", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1:http"} {
		_, err := Parse([]string{"--metrics-addr", bad}, env(nil))
		if _, ok := errors.AsType[*Invalid](err); !ok || !strings.Contains(err.Error(), "--metrics-addr") || !strings.Contains(err.Error(), "IP:port") && !strings.Contains(err.Error(), "1..65535") {
			t.Errorf("--metrics-addr %s: %v, want an *Invalid naming the flag and what is allowed", bad, err)
		}
	}
}

// Every refusal of Parse is one *Invalid, one line naming each bad
// setting as given: a managed plugin's output reaches dockerd's log line
// by line.
func TestParseRefusalIsOneLine(t *testing.T) {
	_, err := Parse([]string{"--scope", "cluster", "--vxlan-port", "0"}, env(map[string]string{"OVERLAYD_LOG_LEVEL": "loud"}))
	var inv *Invalid
	if !errors.As(err, &inv) {
		t.Fatalf("Parse: %v (%T), want *Invalid", err, err)
	}
	msg := err.Error()
	if strings.Contains(msg, "\n") {
		t.Errorf("refusal spans lines: %q", msg)
	}
	for _, want := range []string{`--scope "cluster"`, `--vxlan-port "0"`, `$OVERLAYD_LOG_LEVEL "loud"`} {
		if !strings.Contains(msg, want) {
			t.Errorf("refusal %q does not name %s", msg, want)
		}
	}
	if _, err := Parse([]string{"--nope"}, env(nil)); !errors.As(err, &inv) {
		t.Errorf("unknown flag: %v (%T), want *Invalid", err, err)
	}
}

func TestSourceSaysHowASettingWasGiven(t *testing.T) {
	st, err := Parse([]string{"--gossip-addr", "192.0.2.9"}, env(map[string]string{"OVERLAYD_ADVERTISE_ADDR": "192.0.2.1"}))
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"gossip-addr": "--gossip-addr", "advertise-addr": "$OVERLAYD_ADVERTISE_ADDR", "secret-file": "--secret-file"} {
		if got := st.Source(name); got != want {
			t.Errorf("Source(%s) = %q, want %q", name, got, want)
		}
	}
}

// The client commands' usage is in --help's style and names the
// environment variables.
func TestCommandUsage(t *testing.T) {
	for _, name := range []string{"status", "keys", "leave", "ipam"} {
		if !IsCommand(name) {
			t.Fatalf("%s is not a command", name)
		}
		var b bytes.Buffer
		CommandUsage(&b, "overlayd", name)
		out := b.String()
		for _, want := range []string{"Usage: overlayd " + name, "--control-socket", "$OVERLAYD_CONTROL_SOCKET", "Flags (each also read from its environment variable"} {
			if !strings.Contains(out, want) {
				t.Errorf("%s usage lacks %q:\n%s", name, want, out)
			}
		}
	}
	if IsCommand("serve") {
		t.Error("serve is not a client command")
	}
}

// TestUnknownEnvWarnsWithSuggestion: a misspelt OVERLAYD_ variable is
// named with the setting it was meant to be; settings and other variables
// pass without a word.
func TestUnknownEnvWarnsWithSuggestion(t *testing.T) {
	got := UnknownEnv([]string{
		"OVERLAYD_JION=192.0.2.1",
		"OVERLAYD_JOIN=192.0.2.2",
		"OVERLAYD_SECRETFILE=/etc/overlayd/key",
		"OVERLAYD_SOMETHING_ELSE=1",
		"PATH=/bin",
		"XOVERLAYD_JION=1",
	})
	want := []string{
		"environment variable OVERLAYD_JION is not a setting of overlayd and is ignored (did you mean OVERLAYD_JOIN?); overlayd --help lists the settings",
		"environment variable OVERLAYD_SECRETFILE is not a setting of overlayd and is ignored (did you mean OVERLAYD_SECRET_FILE?); overlayd --help lists the settings",
		"environment variable OVERLAYD_SOMETHING_ELSE is not a setting of overlayd and is ignored; overlayd --help lists the settings",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("UnknownEnv:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// --gossip-profile: lan by default, wan by name, explicit timings on a
// base; a bad value is refused in one line naming the setting, the key and
// what is allowed.
func TestGossipProfile(t *testing.T) {
	st, err := Parse(nil, env(nil))
	if err != nil || st.GossipProfile.Name != "lan" || st.GossipProfile.ProbeTimeout != 150*time.Millisecond {
		t.Fatalf("default gossip profile: %+v %v", st.GossipProfile, err)
	}
	st, err = Parse(nil, env(map[string]string{"OVERLAYD_GOSSIP_PROFILE": "wan"}))
	if err != nil || st.GossipProfile.Name != "wan" || st.GossipProfile.ProbeInterval != time.Second {
		t.Fatalf("wan: %+v %v", st.GossipProfile, err)
	}
	st, err = Parse([]string{"--gossip-profile", "wan,probe-timeout=800ms,suspicion-mult=5"}, env(nil))
	if err != nil || st.GossipProfile.ProbeTimeout != 800*time.Millisecond || st.GossipProfile.SuspicionMult != 5 ||
		st.GossipProfile.ProbeInterval != time.Second || st.GossipProfile.String() != "wan,probe-timeout=800ms,suspicion-mult=5" {
		t.Fatalf("explicit: %+v %v", st.GossipProfile, err)
	}
	st, err = Parse([]string{"--gossip-profile", "probe-interval=500ms"}, env(nil))
	if err != nil || st.GossipProfile.Name != "lan" || st.GossipProfile.ProbeInterval != 500*time.Millisecond {
		t.Fatalf("explicit without base: %+v %v", st.GossipProfile, err)
	}
	for _, c := range []struct{ val, want string }{
		{"metro", `--gossip-profile "metro": unknown profile "metro": the profiles are lan and wan`},
		{"wan,probe=1s", `unknown timing "probe" (keys: probe-interval,`},
		{"wan,probe-timeout", `"probe-timeout" is not key=value`},
		{"wan,probe-timeout=1s", "probe-timeout 1s: must be shorter than probe-interval (1s)"},
		{"lan,probe-interval=fast", `probe-interval "fast": must be a duration like 500ms`},
		{"lan,suspicion-mult=0", "suspicion-mult 0: must be from 1 to 20"},
		{"lan,gossip-interval=1ms", "gossip-interval 1ms: must be from 10ms to 10s"},
		{"lan,suspicion-mult=3,suspicion-mult=4", "suspicion-mult given twice"},
	} {
		_, err := Parse([]string{"--gossip-profile", c.val}, env(nil))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "allowed: lan, wan") ||
			strings.Contains(err.Error(), "\n") {
			t.Errorf("--gossip-profile %q: %v, want one line containing %q", c.val, err, c.want)
		}
	}
}
