package cluster

import (
	"log/slog"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/testutil/logrec"
)

// TestMemberEventsLoggedOnce: each change of a member an operator cares
// about is one INFO line on the other nodes with the event and keys of
// internal/logkeys: it joined, it failed (records kept for the grace), its
// grace ended, it left (also when the leave comes after its death).
func TestMemberEventsLoggedOnce(t *testing.T) {
	t.Parallel()
	const grace = time.Second
	rec := &logrec.Recorder{}
	nodes := startCluster(t, "ev", hosts("127.0.0.", 241, 3), nodeOpts{tweak: func(c *Config) {
		c.FailedGrace = grace
		if c.NodeName == "ev1" {
			c.Logger = rec.Logger()
		}
	}})
	obs, leaver, failer := nodes[0], nodes[1], nodes[2]
	waitMembers(t, 10*time.Second, nodes)
	for _, n := range nodes[1:] {
		rec.One(t, slog.LevelInfo, logkeys.MemberJoined, []string{logkeys.Member, n.name, logkeys.Addr, n.addr()})
	}

	// A member with records in force fails: kept for the grace, then not.
	failer.publish(241, failer.peer("p", "10.241.0.3"))
	waitConverged(t, 10*time.Second, nodes)
	_ = failer.c.Shutdown()
	waitDead(t, []*node{obs}, failer.name)
	rec.One(t, slog.LevelInfo, logkeys.MemberFailed, []string{logkeys.Member, failer.name, logkeys.Grace, grace.String()})
	waitFor(t, 15*time.Second, "the grace's end logged", func() (bool, string) {
		return len(rec.Events(logkeys.MemberExpired)) > 0, "no member_expired line yet"
	})
	rec.One(t, slog.LevelInfo, logkeys.MemberExpired, []string{logkeys.Member, failer.name, logkeys.Grace, grace.String()})

	// Its leave arrives after its death (twice: a retransmission).
	leave, err := encodeMessage(&message{Type: msgLeave, Origin: failer.name, Incarnation: failer.c.inc})
	if err != nil {
		t.Fatal(err)
	}
	obs.c.handleMessage(leave)
	obs.c.handleMessage(leave)
	rec.One(t, slog.LevelInfo, logkeys.MemberLeft, []string{logkeys.Member, failer.name})

	// A member leaves.
	if err := leaver.c.Leave(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, leaver.name+" left", func() (bool, string) {
		s := memberState(obs.c, leaver.name)
		return s == StateLeft, string(s)
	})
	rec.One(t, slog.LevelInfo, logkeys.MemberLeft, []string{logkeys.Member, leaver.name})
	// Nothing was logged twice meanwhile.
	for ev, want := range map[string]int{logkeys.MemberJoined: 2, logkeys.MemberFailed: 1, logkeys.MemberExpired: 1, logkeys.MemberLeft: 2} {
		if got := rec.Events(ev); len(got) != want {
			t.Errorf("%d %s lines at the end, want %d: %v", len(got), ev, want, got)
		}
	}
}
