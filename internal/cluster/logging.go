package cluster

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"strings"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// rateLimiter lets one log line per key through per period and counts the
// ones it suppressed, so bad input from the network cannot flood the log.
type rateLimiter struct {
	mu     *lockorder.Mutex // LevelLeaf; guards keys
	period time.Duration
	keys   map[string]*rlEntry
}

type rlEntry struct {
	last       time.Time
	suppressed int
}

func newRateLimiter(period time.Duration) *rateLimiter {
	return &rateLimiter{mu: lockorder.New(lockorder.LevelLeaf), period: period, keys: make(map[string]*rlEntry)}
}

// allow reports whether a line for key may be logged now, and how many
// were suppressed since the last one that was.
func (r *rateLimiter) allow(key string, now time.Time) (bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.keys[key]
	if e == nil {
		if len(r.keys) > 1024 { // bounded: forget everything rather than grow
			clear(r.keys)
		}
		e = &rlEntry{}
		r.keys[key] = e
	}
	if !e.last.IsZero() && now.Sub(e.last) < r.period {
		e.suppressed++
		return false, 0
	}
	n := e.suppressed
	e.last, e.suppressed = now, 0
	return true, n
}

// mlLogWriter turns memberlist's log lines ("[LEVEL] memberlist: ...")
// into slog records at the matching level, rate-limited per kind of line,
// and counts the drops memberlist does itself (authentication, label).
// Lines about what a restart or a failure normally causes go to DEBUG
// (see levelFor): overlayd logs the outcome itself, once, at INFO.
type mlLogWriter struct {
	log       *slog.Logger
	rl        *rateLimiter
	dropped   func(DropReason)
	suspected func(node string) // this node's probe of node failed
	// down reports whether node is not known alive and unsuspected here
	// (failed, left, suspected, or unknown); nil: never.
	down func(node string) bool
	// closing reports whether this node is shutting down; nil: never.
	closing func() bool
}

func (w *mlLogWriter) logger() *log.Logger { return log.New(w, "", 0) }

func (w *mlLogWriter) Write(p []byte) (int, error) {
	line := string(bytes.TrimRight(p, "\n"))
	level := slog.LevelInfo
	for _, l := range []struct {
		tag   string
		level slog.Level
	}{{"[DEBUG]", slog.LevelDebug}, {"[INFO]", slog.LevelInfo}, {"[WARN]", slog.LevelWarn}, {"[ERR]", slog.LevelError}, {"[ERROR]", slog.LevelError}} {
		if strings.HasPrefix(line, l.tag) {
			level = l.level
			line = strings.TrimSpace(line[len(l.tag):])
			break
		}
	}
	line = strings.TrimPrefix(line, "memberlist: ")
	level = w.levelFor(line, level)
	lower := strings.ToLower(line)
	switch {
	case strings.Contains(lower, "decrypt") || strings.Contains(lower, "not encrypted") || strings.Contains(lower, "encryption is not configured"):
		w.dropped(DropGossipAuth)
	case strings.Contains(lower, "unacceptable label"):
		w.dropped(DropGossipLabel)
	case strings.HasPrefix(line, "Suspect ") && strings.Contains(line, " has failed"):
		// memberlist: "Suspect %s has failed, no acks received"
		if w.suspected != nil {
			w.suspected(strings.TrimPrefix(line[:strings.Index(line, " has failed")], "Suspect "))
		}
	}
	if !w.log.Enabled(context.Background(), level) {
		return len(p), nil
	}
	if level >= slog.LevelWarn {
		if ok, n := w.rl.allow("ml:"+lineKind(line), time.Now()); !ok {
			return len(p), nil
		} else if n > 0 {
			w.log.Log(context.Background(), level, line, "component", "memberlist", "suppressed", n)
			return len(p), nil
		}
	}
	w.log.Log(context.Background(), level, line, "component", "memberlist")
	return len(p), nil
}

// lineKind reduces a log line to its constant part (up to the first digit,
// colon, quote or parenthesis) to rate-limit lines that differ only in
// addresses and numbers together.
func lineKind(s string) string {
	if i := strings.IndexAny(s, "0123456789:\"'(["); i >= 0 {
		s = s[:i]
	}
	if len(s) > 48 {
		s = s[:48]
	}
	return s
}

// levelFor returns the level for a memberlist line logged at level.
//
// DEBUG, because they describe what a restart or a failure normally
// causes and overlayd logs the outcome itself ("member failed", "member
// joined", "member gone", at INFO, once per event):
//   - a node refuting a suspicion or death of itself, or an alive message
//     it does not agree with (it restarted or stalled);
//   - an alive message for a member at another address (a restart at a
//     new address, handled by NotifyConflict, which logs its own line);
//   - a probe that got no ack ("Suspect X has failed"), a member marked
//     failed, a fallback TCP ping that failed: the steps of failure
//     detection, which either end in a refutation or in "member failed";
//   - a push/pull with a member that is down or suspected here;
//   - anything memberlist says once this node is shutting down: its
//     probes and sends then fail on its own closed sockets ("use of closed
//     network connection", "UDP probes failed"), which is no news.
//
// A push/pull failing with a member that is alive and unsuspected here
// is a WARN at most: memberlist retries it, nothing in this process
// failed, but state may not converge while it lasts.
func (w *mlLogWriter) levelFor(line string, level slog.Level) slog.Level {
	if w.closing != nil && w.closing() {
		return min(level, slog.LevelDebug)
	}
	for _, p := range []string{"Refuting a", "Conflicting address for", "Marking ", "Failed fallback TCP ping"} {
		if strings.HasPrefix(line, p) {
			return min(level, slog.LevelDebug)
		}
	}
	if strings.HasPrefix(line, "Suspect ") && strings.Contains(line, " has failed") {
		return min(level, slog.LevelDebug)
	}
	// memberlist: "Push/Pull with %s failed: %s"
	if rest, ok := strings.CutPrefix(line, "Push/Pull with "); ok {
		if i := strings.Index(rest, " failed"); i > 0 {
			if w.down != nil && w.down(rest[:i]) {
				return min(level, slog.LevelDebug)
			}
			return min(level, slog.LevelWarn)
		}
	}
	return level
}
