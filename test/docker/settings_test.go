package docker

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestManagedPluginBadSetting: a managed plugin given a setting that does
// not fit the host cannot be enabled, and the reason is in dockerd's log
// as one line at level error (the plugin's stderr), naming the
// environment variable, without overlayd's usage text. (dockerd itself
// waits for the plugin's socket before `docker plugin enable` fails, and
// may restart the plugin meanwhile: each start is one such line.)
func TestManagedPluginBadSetting(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	dir, state := l.pluginFiles(t)
	for i, c := range []struct{ setting, reason string }{
		{"OVERLAYD_SCOPE=cluster", `$OVERLAYD_SCOPE \"cluster\": must be local or global`}, // quotes escaped in dockerd's log
		{"OVERLAYD_ADVERTISE_ADDR=203.0.113.9", "$OVERLAYD_ADVERTISE_ADDR 203.0.113.9: not an address of this host"},
	} {
		// A plugin per case: after a failed enable, Docker 20.10 refuses
		// the next enable of the same plugin ("id already in use").
		ref := fmt.Sprintf("overlayd-bad%d:latest", i)
		e.must("plugin", "create", ref, dir)
		e.must("plugin", "set", ref, "state.source="+state, c.setting)
		logFrom := len(e.logTail(1 << 30))
		start := time.Now()
		out, err := e.docker("plugin", "enable", ref)
		timing(t, "docker plugin enable refused by overlayd (dockerd's wait for the socket)", time.Since(start))
		if err == nil {
			t.Fatalf("%s: docker plugin enable succeeded: %s", c.setting, out)
		}
		t.Logf("%s: docker plugin enable: %s", c.setting, out)
		log := e.logTail(1 << 30)[logFrom:]
		var reasons []string
		for _, line := range strings.Split(log, "\n") {
			if strings.Contains(line, "Usage: overlayd") || strings.Contains(line, "Flags (each also read") {
				t.Errorf("%s: overlayd's usage text in dockerd's log: %s", c.setting, line)
			}
			if strings.Contains(line, c.reason) {
				reasons = append(reasons, line)
			}
		}
		if len(reasons) == 0 {
			t.Fatalf("%s: dockerd's log lacks the reason; tail:\n%s", c.setting, e.logTail(40))
		}
		for _, line := range reasons {
			if !strings.Contains(line, "level=error") {
				t.Errorf("%s: the reason is not at level error in dockerd's log: %s", c.setting, line)
			}
		}
		t.Logf("%s: dockerd's log (%d start(s)): %s", c.setting, len(reasons), reasons[0])
		e.dockerQuiet("plugin", "rm", "-f", ref)
	}
}
