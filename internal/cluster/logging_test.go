package cluster

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// logCapture keeps every log record it is given, at every level.
type logCapture struct {
	mu   sync.Mutex
	recs []capturedLog
}

type capturedLog struct {
	level slog.Level
	msg   string
	attrs string
}

func (c *logCapture) logger() *slog.Logger { return slog.New(&captureHandler{c: c}) }

func (c *logCapture) lines() []capturedLog {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]capturedLog(nil), c.recs...)
}

// count returns how many records have msg.
func (c *logCapture) count(msg string) int {
	n := 0
	for _, r := range c.lines() {
		if r.msg == msg {
			n++
		}
	}
	return n
}

type captureHandler struct {
	c     *logCapture
	attrs string
}

func (h *captureHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *captureHandler) Handle(_ context.Context, r slog.Record) error {
	var b bytes.Buffer
	b.WriteString(h.attrs)
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s=%v", a.Key, a.Value); return true })
	h.c.mu.Lock()
	h.c.recs = append(h.c.recs, capturedLog{r.Level, r.Message, b.String()})
	h.c.mu.Unlock()
	return nil
}
func (h *captureHandler) WithAttrs(as []slog.Attr) slog.Handler {
	var b strings.Builder
	b.WriteString(h.attrs)
	for _, a := range as {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
	}
	return &captureHandler{c: h.c, attrs: b.String()}
}
func (h *captureHandler) WithGroup(string) slog.Handler { return h }

// TestMemberlistLineLevels: memberlist's lines about what restarts and
// failures normally cause go to DEBUG (overlayd logs the outcome itself);
// a push/pull failing with a member alive here is a WARN, never an ERROR;
// everything else keeps memberlist's level.
func TestMemberlistLineLevels(t *testing.T) {
	lc := &logCapture{}
	var closing atomic.Bool
	w := &mlLogWriter{log: lc.logger(), rl: newRateLimiter(time.Minute), dropped: func(DropReason) {},
		down: func(node string) bool { return node == "restarting" }, closing: closing.Load}
	cases := []struct {
		line string
		want slog.Level
	}{
		{"[WARN] memberlist: Refuting a suspect message (from: h2)", slog.LevelDebug},
		{"[WARN] memberlist: Refuting a dead message (from: h2)", slog.LevelDebug},
		{"[WARN] memberlist: Refuting an alive message for 'h1' (192.0.2.1:7947) meta:([1] VS [2]), vsn:([1] VS [2])", slog.LevelDebug},
		{"[ERR] memberlist: Conflicting address for h3. Mine: 192.0.2.3:7947 Theirs: 192.0.2.33:7947 Old state: 2", slog.LevelDebug},
		{"[INFO] memberlist: Suspect restarting has failed, no acks received", slog.LevelDebug},
		{"[INFO] memberlist: Marking restarting as failed, suspect timeout reached (1 peer confirmations)", slog.LevelDebug},
		{"[ERR] memberlist: Failed fallback TCP ping: timeout 1s: read tcp 192.0.2.1:40000->192.0.2.2:7947: i/o timeout", slog.LevelDebug},
		{"[ERR] memberlist: Push/Pull with restarting failed: dial tcp 192.0.2.2:7947: connect: connection refused", slog.LevelDebug},
		{"[ERR] memberlist: Push/Pull with alive-one failed: read tcp 192.0.2.1:40000->192.0.2.3:7947: i/o timeout", slog.LevelWarn},
		{"[ERR] memberlist: Decrypt packet failed: No installed keys could decrypt the message from=192.0.2.9:7947", slog.LevelError},
		{"[WARN] memberlist: Was able to connect to h4 over TCP but UDP probes failed, network may be misconfigured", slog.LevelWarn},
		{"[DEBUG] memberlist: Stream connection from=192.0.2.2:40000", slog.LevelDebug},
		// Once this node shuts down, its own closed sockets are no news.
		{"closing", 0},
		{"[ERR] memberlist: Failed to send UDP ping: write udp 192.0.2.1:40000->192.0.2.2:7947: use of closed network connection", slog.LevelDebug},
		{"[WARN] memberlist: Was able to connect to h4 over TCP but UDP probes failed, network may be misconfigured", slog.LevelDebug},
	}
	for _, c := range cases {
		if c.line == "closing" {
			closing.Store(true)
			continue
		}
		before := len(lc.lines())
		if _, err := w.Write([]byte(c.line + "\n")); err != nil {
			t.Fatal(err)
		}
		got := lc.lines()
		if len(got) != before+1 {
			t.Fatalf("%q: %d records, want 1", c.line, len(got)-before)
		}
		if l := got[before]; l.level != c.want || strings.Contains(l.msg, "memberlist:") || strings.HasPrefix(l.msg, "[") {
			t.Errorf("%q: logged %s %q, want %s without memberlist's prefix", c.line, l.level, l.msg, c.want)
		}
	}
}

// TestRestartLogsOnlyOutcomes: a member restarting (shut down without
// leaving, back as a new process at the same address) is routine: no
// memberlist line reaches INFO on any node, and the others tell the
// outcome in overlayd's own lines, once each.
func TestRestartLogsOnlyOutcomes(t *testing.T) {
	t.Parallel()
	caps := map[string]*logCapture{}
	var capMu sync.Mutex
	tweak := func(c *Config) {
		capMu.Lock()
		defer capMu.Unlock()
		if caps[c.NodeName] == nil {
			caps[c.NodeName] = &logCapture{}
		}
		c.Logger = caps[c.NodeName].logger()
	}
	nodes := startCluster(t, "lg", hosts("127.0.0.", 171, 3), nodeOpts{tweak: tweak})
	waitMembers(t, 10*time.Second, nodes)
	r, obs := nodes[2], nodes[:2]
	r.publish(171, r.peer("keep", "10.171.0.2"))
	waitConverged(t, 10*time.Second, nodes)
	_ = r.c.Shutdown()
	waitDead(t, obs, r.name)
	r.restart("", obs[0].addr(), tweak, func(r *node) { r.publish(171, r.peer("keep", "10.171.0.2")) })
	waitAliveAs(t, 15*time.Second, obs, r)
	waitConverged(t, 10*time.Second, nodes)
	capMu.Lock()
	defer capMu.Unlock()
	for name, lc := range caps {
		for _, l := range lc.lines() {
			// "UDP probes failed" stays a WARN on purpose (it is how a
			// firewall dropping the gossip's UDP shows) and has nothing to
			// do with a restart: on a starved machine a late ack of any
			// member makes it, so it is not held against the restart.
			if strings.Contains(l.attrs, "component=memberlist") && l.level >= slog.LevelInfo && !strings.Contains(l.msg, "UDP probes failed") {
				t.Errorf("%s: memberlist line at %s: %s%s", name, l.level, l.msg, l.attrs)
			}
		}
	}
	for _, o := range obs {
		if n := caps[o.name].count("member failed; its records stay in force until its return or the grace's end"); n != 1 {
			t.Errorf("%s: %d 'member failed' lines, want 1", o.name, n)
		}
	}
}

// TestJoinedTheClusterOnce: a node given several seeds of one cluster
// says "joined the cluster" once, not once per seed.
func TestJoinedTheClusterOnce(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, "jo", hosts("127.0.0.", 181, 2), nodeOpts{})
	waitMembers(t, 10*time.Second, nodes)
	lc := &logCapture{}
	late := startNode(t, "jo3", "127.0.0.183", 0, nodeOpts{seeds: []string{nodes[0].addr(), nodes[1].addr()},
		tweak: func(c *Config) { c.Logger = lc.logger() }})
	waitMembers(t, 10*time.Second, append(nodes, late))
	// Wait until the joiner has dealt with every seed (joined through it,
	// or found it a member).
	waitFor(t, 10*time.Second, "every seed dealt with", func() (bool, string) {
		j := late.c.joiner
		j.mu.Lock()
		defer j.mu.Unlock()
		for a, s := range j.seed {
			if !s.joined {
				return false, a + " not joined yet"
			}
		}
		return true, ""
	})
	if n := lc.count("joined the cluster"); n != 1 {
		t.Errorf("%d 'joined the cluster' lines, want 1: %v", n, lc.lines())
	}
	for _, r := range lc.lines() {
		if r.msg == "joined the cluster" && !strings.Contains(r.attrs, " event=cluster_joined") {
			t.Errorf("'joined the cluster' without event=cluster_joined: %q", r.attrs)
		}
	}
}
