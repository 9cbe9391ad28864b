package cluster

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
)

// appInbox records the application messages a node is handed.
type appInbox struct {
	mu   sync.Mutex
	msgs []appMsg
}

type appMsg struct {
	from    string
	payload []byte
}

func (b *appInbox) deliver(from string, payload []byte) {
	b.mu.Lock()
	b.msgs = append(b.msgs, appMsg{from, payload})
	b.mu.Unlock()
}

func (b *appInbox) all() []appMsg {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]appMsg(nil), b.msgs...)
}

// startAppCluster starts n nodes on 127.0.0.from…, each with an inbox.
func startAppCluster(t *testing.T, prefix string, from, n int, tweak func(*Config)) ([]*node, []*appInbox) {
	t.Helper()
	boxes := make([]*appInbox, n)
	var nodes []*node
	for i, h := range hosts("127.0.0.", from, n) {
		box := &appInbox{}
		boxes[i] = box
		o := nodeOpts{tweak: func(c *Config) {
			c.OnAppMessage = box.deliver
			if tweak != nil {
				tweak(c)
			}
		}}
		if i > 0 {
			o.seeds = []string{nodes[0].addr()}
		}
		nodes = append(nodes, startNode(t, fmt.Sprintf("%s%d", prefix, i+1), h, 0, o))
	}
	waitMembers(t, 10*time.Second, nodes)
	return nodes, boxes
}

// TestAppMessagesDelivered: SendApp delivers the payload, once and intact,
// to the named member's OnAppMessage with the sender's name, up to
// MaxAppPayload; counted on both sides; every refusal names why and sends
// nothing.
func TestAppMessagesDelivered(t *testing.T) {
	t.Parallel()
	nodes, boxes := startAppCluster(t, "am", 211, 3, nil)
	a, b, c := nodes[0], nodes[1], nodes[2]
	// Members learn each other's current incarnation through memberlist
	// (NotifyJoin) before the first message can be accepted.
	small := []byte("claim 198.51.100.0/24")
	big := bytes.Repeat([]byte{0xa5, 0x5a, 0x00, 0xff}, MaxAppPayload/4)
	beforeA, beforeB := a.c.Status().Stats, b.c.Status().Stats
	if err := a.c.SendApp(b.name, small); err != nil {
		t.Fatalf("SendApp %s -> %s: %v", a.name, b.name, err)
	}
	if err := a.c.SendApp(b.name, big); err != nil {
		t.Fatalf("SendApp of %d bytes: %v", len(big), err)
	}
	waitFor(t, 10*time.Second, "both messages at "+b.name, func() (bool, string) {
		return len(boxes[1].all()) == 2, fmt.Sprint(len(boxes[1].all()), " delivered")
	})
	got := boxes[1].all()
	// Two streams: either order.
	if got[0].from != a.name || got[1].from != a.name {
		t.Fatalf("senders %q, %q, want %q", got[0].from, got[1].from, a.name)
	}
	if !(bytes.Equal(got[0].payload, small) && bytes.Equal(got[1].payload, big) ||
		bytes.Equal(got[1].payload, small) && bytes.Equal(got[0].payload, big)) {
		t.Fatalf("payloads of %d and %d bytes, want %d and %d, intact", len(got[0].payload), len(got[1].payload), len(small), len(big))
	}
	if n := len(boxes[0].all()) + len(boxes[2].all()); n != 0 {
		t.Fatalf("%d messages delivered to members they were not sent to", n)
	}
	afterA, afterB := a.c.Status().Stats, b.c.Status().Stats
	if afterA.AppMessagesSent-beforeA.AppMessagesSent != 2 || afterA.MessagesSent-beforeA.MessagesSent < 2 {
		t.Errorf("%s counted %d application messages sent (%d in all), want 2", a.name,
			afterA.AppMessagesSent-beforeA.AppMessagesSent, afterA.MessagesSent-beforeA.MessagesSent)
	}
	if afterB.AppMessagesReceived-beforeB.AppMessagesReceived != 2 {
		t.Errorf("%s counted %d application messages received, want 2", b.name, afterB.AppMessagesReceived-beforeB.AppMessagesReceived)
	}

	// Refused before anything is sent.
	sent := a.c.Status().Stats.AppMessagesSent
	for _, tc := range []struct {
		name, to string
		payload  []byte
		want     string
		notReach bool
	}{
		{"empty payload", b.name, nil, "must be 1..1048576 bytes", false},
		{"payload over 1 MiB", b.name, make([]byte, MaxAppPayload+1), "must be 1..1048576 bytes", false},
		{"unknown member", "nobody", small, "no such member", true},
		{"this node", a.name, small, "it is this node", true},
	} {
		err := a.c.SendApp(tc.to, tc.payload)
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte(tc.want)) || errors.Is(err, ErrNotReachable) != tc.notReach {
			t.Errorf("%s: SendApp error %v, want one saying %q (ErrNotReachable: %v)", tc.name, err, tc.want, tc.notReach)
		}
	}
	if n := a.c.Status().Stats.AppMessagesSent; n != sent {
		t.Errorf("refused sends counted as sent: %d -> %d", sent, n)
	}

	// A dead member: refused, naming its state.
	c.stop()
	waitFor(t, 10*time.Second, c.name+" dead at "+a.name, func() (bool, string) {
		st, _, _ := a.c.memberInfo(c.name)
		return st == StateDead, string(st)
	})
	if err := a.c.SendApp(c.name, small); err == nil || !errors.Is(err, ErrNotReachable) || !bytes.Contains([]byte(err.Error()), []byte("it is dead")) {
		t.Errorf("SendApp to a dead member: %v, want ErrNotReachable saying it is dead", err)
	}
}

// TestAppMessagesValidated: an application message is accepted only from
// an alive member's current incarnation that speaks protocol 3; the
// others are dropped and counted, and never reach OnAppMessage. A member
// of protocol 2 is never sent one.
func TestAppMessagesValidated(t *testing.T) {
	t.Parallel()
	nodes, boxes := startAppCluster(t, "av", 221, 2, nil)
	a, b := nodes[0], nodes[1]
	target := &memberlist.Node{Name: a.name, Addr: net.ParseIP(a.host), Port: uint16(a.port)}
	send := func(m *message) {
		t.Helper()
		if err := b.c.ml.SendReliable(target, mustEncode(t, m)); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	for _, tc := range []struct {
		name   string
		m      *message
		reason DropReason
	}{
		{"old incarnation", &message{Type: msgApp, Origin: b.name, Incarnation: b.c.inc - 1, Payload: []byte("x")}, DropIncarnation},
		{"not a member", &message{Type: msgApp, Origin: "nobody", Incarnation: 1, Payload: []byte("x")}, DropUnknownOrig},
		{"this node's name", &message{Type: msgApp, Origin: a.name, Incarnation: a.c.inc, Payload: []byte("x")}, DropSelfOrigin},
	} {
		before := a.c.Status().Dropped[tc.reason]
		send(tc.m)
		waitFor(t, 5*time.Second, tc.name+" dropped as "+string(tc.reason), func() (bool, string) {
			n := a.c.Status().Dropped[tc.reason]
			return n == before+1, fmt.Sprint(n - before)
		})
	}
	// The valid one, sent last over the same path, arrives: the ones
	// before it were dropped, not merely slow.
	send(&message{Type: msgApp, Origin: b.name, Incarnation: b.c.inc, Payload: []byte("ok")})
	waitFor(t, 5*time.Second, "the valid message", func() (bool, string) { return len(boxes[0].all()) == 1, fmt.Sprint(len(boxes[0].all())) })
	if m := boxes[0].all()[0]; m.from != b.name || string(m.payload) != "ok" {
		t.Fatalf("delivered %+v, want only the valid message from %s", m, b.name)
	}

	// b becomes a protocol-2 node (an overlayd from before application
	// messages): a refuses to send it one, and drops one it sends.
	b.advertiseProtocol(2)
	waitFor(t, 10*time.Second, "the protocol-2 metadata at "+a.name, func() (bool, string) {
		for _, m := range a.c.AppMembers() {
			if m.Name == b.name {
				return !m.App, fmt.Sprintf("%+v", m)
			}
		}
		return false, "not listed"
	})
	if err := a.c.SendApp(b.name, []byte("x")); err == nil || !errors.Is(err, ErrNotReachable) || !bytes.Contains([]byte(err.Error()), []byte("speaks protocol 2")) {
		t.Errorf("SendApp to a protocol-2 member: %v, want ErrNotReachable naming its protocol", err)
	}
	before := a.c.Status().Dropped[DropProtocol]
	send(&message{Type: msgApp, Origin: b.name, Incarnation: b.c.inc, Payload: []byte("late")})
	waitFor(t, 5*time.Second, "the protocol-2 member's message dropped", func() (bool, string) {
		n := a.c.Status().Dropped[DropProtocol]
		return n == before+1, fmt.Sprint(n - before)
	})
	if n := len(boxes[0].all()); n != 1 {
		t.Fatalf("%d messages delivered, want still 1", n)
	}
}

// TestAppMembersAndJoined: AppMembers lists the other members with their
// state (never this node, never one that left); Joined is true at once for
// a node without seeds, false for one whose seeds do not answer, and true
// once it has met another member.
func TestAppMembersAndJoined(t *testing.T) {
	t.Parallel()
	nodes, _ := startAppCluster(t, "aj", 231, 3, nil)
	a, b, c := nodes[0], nodes[1], nodes[2]
	for _, n := range nodes {
		if !n.c.Joined() {
			t.Errorf("%s: not Joined in a cluster of 3", n.name)
		}
	}
	list := func(n *node) string { return fmt.Sprintf("%+v", n.c.AppMembers()) }
	want := fmt.Sprintf("[{Name:%s State:alive App:true} {Name:%s State:alive App:true}]", b.name, c.name)
	if got := list(a); got != want {
		t.Fatalf("%s: AppMembers %s, want %s", a.name, got, want)
	}
	c.stop()
	want = fmt.Sprintf("[{Name:%s State:alive App:true} {Name:%s State:dead App:true}]", b.name, c.name)
	waitFor(t, 10*time.Second, c.name+" dead", func() (bool, string) { return list(a) == want, list(a) })
	if err := b.c.Leave(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	want = fmt.Sprintf("[{Name:%s State:dead App:true}]", c.name)
	waitFor(t, 10*time.Second, b.name+" gone from the list", func() (bool, string) { return list(a) == want, list(a) })
	if !a.c.Joined() {
		t.Errorf("%s: no longer Joined once alone (it has been in a cluster)", a.name)
	}

	// A node whose only seed does not answer is not joined; once it
	// meets a member it is.
	lone := startNode(t, "aj-lone", "127.0.0.234", 0, nodeOpts{seeds: []string{fmt.Sprintf("127.0.0.235:%d", freePort(t, "127.0.0.235"))}})
	if lone.c.Joined() {
		t.Fatal("a node whose seeds never answered reports Joined")
	}
	alone := startNode(t, "aj-first", "127.0.0.236", 0, nodeOpts{})
	if !alone.c.Joined() {
		t.Fatal("a node without seeds (the first host) does not report Joined")
	}
	lone.c.AddSeeds(a.addr())
	waitFor(t, 10*time.Second, "the lone node to join", func() (bool, string) { return lone.c.Joined(), list(lone) })
}

// BenchmarkAppRoundTrip: a request and its answer between two members on
// loopback, each a SendApp (a TCP stream, encrypted), the answer sent from
// a goroutine the receiver's OnAppMessage hands it to (as the allocator
// does). This is the network's part of obtaining address space from
// another host. Reports p50 and p99 of the round trip.
func BenchmarkAppRoundTrip(b *testing.B) {
	answers := make(chan string, 64)
	type request struct {
		from    string
		payload []byte
	}
	requests := make(chan request, 64)
	var nodes []*node
	for i, h := range hosts("127.0.0.", 215, 2) {
		o := nodeOpts{tweak: func(c *Config) {
			if i == 0 {
				c.OnAppMessage = func(_ string, p []byte) { answers <- string(p) }
			} else {
				c.OnAppMessage = func(from string, p []byte) { requests <- request{from, p} }
			}
		}}
		if i > 0 {
			o.seeds = []string{nodes[0].addr()}
		}
		nodes = append(nodes, startNode(b, fmt.Sprintf("ab%d", i+1), h, 0, o))
	}
	a, peer := nodes[0], nodes[1]
	waitMembers(b, 10*time.Second, nodes)
	stop := make(chan struct{})
	defer close(stop)
	go func() { // the receiver's worker: it answers with the request's bytes
		for {
			select {
			case r := <-requests:
				_ = peer.c.SendApp(r.from, r.payload)
			case <-stop:
				return
			}
		}
	}()
	// roundTrip sends id and waits for its answer (skipping late answers
	// to earlier tries) up to timeout.
	roundTrip := func(id string, timeout time.Duration) error {
		if err := a.c.SendApp(peer.name, []byte(id)); err != nil {
			return err
		}
		t := time.NewTimer(timeout)
		defer t.Stop()
		for {
			select {
			case got := <-answers:
				if got == id {
					return nil
				}
			case <-t.C:
				return fmt.Errorf("no answer to %s", id)
			}
		}
	}
	// The first messages may arrive before the peer accepts a's
	// incarnation (dropped): try until one comes back.
	try := 0
	waitFor(b, 10*time.Second, "a first round trip", func() (bool, string) {
		try++
		err := roundTrip(fmt.Sprintf("warm-up-%d", try), 200*time.Millisecond)
		return err == nil, fmt.Sprint(err)
	})
	var rtts []time.Duration
	n := 0
	for b.Loop() {
		n++
		start := time.Now()
		if err := roundTrip(fmt.Sprintf("req-%0200d", n), 10*time.Second); err != nil {
			b.Fatal(err)
		}
		rtts = append(rtts, time.Since(start))
	}
	b.ReportMetric(float64(pct(rtts, 50).Microseconds()), "p50-µs")
	b.ReportMetric(float64(pct(rtts, 99).Microseconds()), "p99-µs")
}
