package cluster

import (
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
)

// dest is the sender to one alive member: a goroutine with a queue, so a
// slow or unreachable member (TCP dial timeouts) delays nobody else.
type dest struct {
	name string
	stop chan struct{} // closed (under Cluster.mu) when the member is gone
	wake chan struct{}

	// mu (LevelClusterSender) is taken under Cluster.mu or alone; it
	// guards every field below.
	mu     *lockorder.Mutex
	node   memberlist.Node // written with both Cluster.mu and mu held; read under either
	queue  [][]byte        // encoded deltas, in order
	queued int             // bytes in queue
	// snapshot: send our complete snapshot (supersedes the queue);
	// syncReq: ask the member for its snapshot; digest: latest digest.
	snapshot, syncReq bool
	digest            []byte
	// defs: send our definitions (defs.go); defsOK: the member speaks
	// protocolDefs (it would drop them otherwise).
	defs, defsOK bool
	// For a member that wants only some VNIs (interest.go): records went
	// to it (deltas or a snapshot) since its last digest, and what that
	// digest said (count, hash, our definitions' version) and when. A
	// digest that would repeat the last one to a member sent nothing
	// since is skipped in the rounds that follow a change (not in the
	// idle round, nor once DigestMaxInterval has passed since the last):
	// a change of a 5-host network does not cost a digest to every member.
	sentRecords  bool
	lastCount    uint64
	lastHash     uint64
	lastDefsVer  uint64
	lastDigestAt time.Time
	// proto: the highest protocol the member speaks. It is never sent a
	// record it cannot decode (record.needs; it would drop the whole
	// message).
	proto byte
	// defs6: the member speaks protoDefs6 (definitions with IPv6).
	defs6 bool
}

// maxQueued bounds a sender's queue; beyond it the queue is replaced by
// one snapshot (which is built when sent, so it holds everything).
const maxQueued = 8 << 20

func newDest(n *memberlist.Node) *dest {
	d := &dest{name: n.Name, stop: make(chan struct{}), wake: make(chan struct{}, 1),
		mu: lockorder.New(lockorder.LevelClusterSender), proto: protocolVersionMin}
	d.node = *n
	d.node.Meta = nil
	return d
}

func (d *dest) setNode(n *memberlist.Node) {
	d.mu.Lock()
	d.node = *n
	d.node.Meta = nil
	d.mu.Unlock()
}

func (d *dest) signal() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// enqueue queues msgs; needs is the lowest protocol that decodes all their
// records: a member of an older protocol gets a snapshot instead (built
// when sent, in the form the records then have).
func (d *dest) enqueue(msgs [][]byte, needs byte) {
	d.mu.Lock()
	if needs > d.proto {
		d.queue, d.queued, d.snapshot = nil, 0, true
	}
	if !d.snapshot {
		for _, m := range msgs {
			d.queue = append(d.queue, m)
			d.queued += len(m)
		}
		d.sentRecords = d.sentRecords || len(msgs) > 0
		if d.queued > maxQueued {
			d.queue, d.queued, d.snapshot = nil, 0, true
		}
	}
	d.mu.Unlock()
	d.signal()
}

// sendLoop sends, in this order: a sync request, our snapshot (dropping
// the deltas queued before it, which it contains), the queued deltas, and
// the latest digest (after the deltas it summarises).
func (c *Cluster) sendLoop(d *dest) {
	select { // memberlist may report members before Create returns
	case <-c.ready:
	case <-d.stop:
		return
	}
	backoff := 100 * time.Millisecond
	for {
		select {
		case <-d.wake:
		case <-d.stop:
			return
		}
		for {
			d.mu.Lock()
			node := d.node
			syncReq, snap, queue, digest, proto := d.syncReq, d.snapshot, d.queue, d.digest, d.proto
			defs, defs6 := d.defs && d.defsOK, d.defs6
			d.syncReq, d.snapshot, d.queue, d.queued, d.digest, d.defs = false, false, nil, 0, nil, false
			d.sentRecords = d.sentRecords || snap
			d.mu.Unlock()
			if !syncReq && !snap && len(queue) == 0 && digest == nil && !defs {
				break
			}
			if snap {
				queue = nil
			}
			failed := false
			if syncReq {
				b, err := encodeMessage(&message{Type: msgSyncRequest, Origin: c.cfg.NodeName, Incarnation: c.inc})
				if err == nil {
					failed = c.send(&node, b) != nil
				}
			}
			// Definitions before records: a receiver holds back our
			// records of a VNI until it has our definition of it.
			if defs && !failed {
				b, err := encodeMessage(c.local.defsMessage(defs6))
				if err != nil {
					c.logLimited(slog.LevelError, "defs", "cannot encode the network definitions", "error", err)
				} else {
					failed = c.send(&node, b) != nil
				}
			}
			if snap && !failed {
				c.mu.Lock()
				want := c.replica.interestOf(d.name)
				c.mu.Unlock()
				m := c.local.snapshotFor(want)
				if proto < ProtocolVersion {
					m.Records = downgrade(m.Records, proto)
				}
				b, err := encodeMessage(m)
				if err != nil {
					c.logLimited(slog.LevelError, "snapshot", "cannot encode the local snapshot", "error", err)
				} else if c.send(&node, b) != nil {
					failed = true
				}
			}
			for _, b := range queue {
				if failed {
					break
				}
				failed = c.send(&node, b) != nil
			}
			if digest != nil && !failed {
				failed = c.send(&node, digest) != nil
			}
			if failed {
				// Something may be lost: resend everything as a snapshot
				// after a backoff (memberlist will declare the member dead
				// if it is, which stops this sender).
				d.mu.Lock()
				d.snapshot, d.queue, d.queued = true, nil, 0
				d.syncReq = d.syncReq || syncReq
				d.defs = d.defs || defs
				d.mu.Unlock()
				t := time.NewTimer(backoff + rand.N(backoff/2))
				select {
				case <-t.C:
				case <-d.stop:
					t.Stop()
					return
				}
				backoff = min(2*backoff, 5*time.Second)
				continue
			}
			backoff = 100 * time.Millisecond
		}
	}
}

// send sends b to n: one UDP packet if it fits, else over TCP.
func (c *Cluster) send(n *memberlist.Node, b []byte) error {
	var err error
	if len(b) <= c.budget {
		err = c.ml.SendBestEffort(n, b)
	} else {
		err = c.ml.SendReliable(n, b)
	}
	if err != nil {
		c.sendErrors.Add(1)
		c.logLimited(slog.LevelWarn, "send:"+n.Name, "sending to a member failed", logkeys.Member, n.Name, "bytes", len(b), "error", err)
		return err
	}
	c.msgsSent.Add(1)
	c.bytesSent.Add(uint64(len(b)))
	return nil
}

// publishLoop sends our changed records to every member as soon as they
// change: whatever accumulated while the previous batch was being sent
// goes in the next one (natural batching: a burst of 1,000 endpoints
// becomes a few messages).
func (c *Cluster) publishLoop() {
	for {
		select {
		case <-c.pubWake:
		case <-c.stop:
			return
		}
		for len(c.localErrs) > 0 {
			e := <-c.localErrs
			c.logLimited(slog.LevelError, "local:"+string(e.reason), "refusing to publish an invalid local record",
				"vni", e.vni, "reason", e.reason, "record", e.rec, "vtep", c.local.currentVTEP())
		}
		recs := c.local.takeDirty()
		defs := c.defsChanged.Swap(false)
		if len(recs) == 0 && !defs {
			continue
		}
		// Each member gets the records of the VNIs it wants (interest.go),
		// as of its interest now: one that gains a VNI later is sent a
		// snapshot, which holds these records too.
		type target struct {
			d    *dest
			want interest
		}
		c.mu.Lock()
		ts := make([]target, 0, len(c.dests))
		for name, d := range c.dests {
			ts = append(ts, target{d, c.replica.interestOf(name)})
		}
		c.mu.Unlock()
		sets := newDeltaSets(c, recs)
		for _, t := range ts {
			if defs {
				t.d.mu.Lock()
				t.d.defs = true
				t.d.mu.Unlock()
			}
			var msgs [][]byte
			needs := protocolVersionMin
			if len(recs) > 0 {
				msgs, needs = sets.forInterest(t.want)
			}
			if len(msgs) > 0 || defs {
				t.d.enqueue(msgs, needs)
			}
		}
		select {
		case c.changed <- struct{}{}:
		default:
		}
	}
}

// encodeDeltas packs records into UDP-sized deltas when they need at most
// four packets, else into deltas of up to largeChunk for TCP.
func (c *Cluster) encodeDeltas(recs []record) [][]byte {
	total := 0
	for i := range recs {
		total += recordSize(&recs[i])
	}
	limit := c.budget
	if total > 4*(c.budget-headerFixed-len(c.cfg.NodeName)-8) {
		limit = largeChunk
	}
	e := newDeltaEncoder(c.cfg.NodeName, c.inc, limit)
	for i := range recs {
		e.add(&recs[i])
	}
	return e.messages()
}

// periodicLoop sends digests (DigestInterval after a change, then at
// doubling intervals up to DigestMaxInterval), ends restart and failed
// graces and repeats unanswered sync requests (every 250 ms), and reaps
// tombstones (every TombstoneTTL/8).
func (c *Cluster) periodicLoop() {
	jitter := func(d time.Duration) time.Duration {
		return d - d/5 + rand.N(2*d/5+1)
	}
	step := c.cfg.DigestInterval
	next := c.now().Add(step)
	digest := time.NewTimer(jitter(step))
	tick := time.NewTicker(250 * time.Millisecond)
	reapEvery := max(250*time.Millisecond, c.cfg.TombstoneTTL/8)
	nextReap := c.now().Add(reapEvery)
	defer digest.Stop()
	defer tick.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-c.changed:
			// A change was sent: digest soon, then back off again.
			step = c.cfg.DigestInterval
			if d := next.Sub(c.now()); d > step {
				next = c.now().Add(step)
				digest.Reset(jitter(step))
			}
		case <-digest.C:
			c.sendDigests(step >= c.cfg.DigestMaxInterval)
			step = min(2*step, c.cfg.DigestMaxInterval)
			next = c.now().Add(step)
			digest.Reset(jitter(step))
		case <-tick.C:
			now := c.now()
			reap := !now.Before(nextReap)
			if reap {
				nextReap = now.Add(reapEvery)
				c.local.reap(now, c.cfg.TombstoneTTL)
			}
			var expired []string
			c.mu.Lock()
			if reap {
				expired = c.replica.reap(now, c.cfg.TombstoneTTL, c.cfg.ReconnectTimeout)
			} else {
				expired = c.replica.tick(now)
			}
			c.mu.Unlock()
			for _, name := range expired {
				c.log.Info("failed member did not return within the grace; its records are no longer in force",
					logkeys.Event, logkeys.MemberExpired, logkeys.Member, name, logkeys.Grace, c.cfg.FailedGrace)
			}
		}
	}
}

// sendDigests queues our digest to every member: over the VNIs it wants
// (interest.go), the whole one (encoded once) to the others. idleRound:
// the round of the idle rate (DigestMaxInterval), which every member
// gets; in the rounds that follow a change, a member that wants only some
// VNIs and would be told what it was told last is skipped.
func (c *Cluster) sendDigests(idleRound bool) {
	var whole []byte
	now := c.now()
	defsVer := c.local.defsVersion()
	c.mu.Lock()
	defer c.mu.Unlock()
	for name, d := range c.dests {
		want := c.replica.interestOf(name)
		var b []byte
		if want == nil {
			if whole == nil {
				var err error
				if whole, err = encodeMessage(c.local.digest()); err != nil {
					return
				}
			}
			b = whole
		} else {
			m := c.local.digestFor(want)
			d.mu.Lock()
			repeat := !idleRound && !d.sentRecords && d.lastCount == m.Count && d.lastHash == m.Hash && d.lastDefsVer == defsVer &&
				now.Sub(d.lastDigestAt) < c.cfg.DigestMaxInterval
			if !repeat {
				d.sentRecords, d.lastCount, d.lastHash, d.lastDefsVer, d.lastDigestAt = false, m.Count, m.Hash, defsVer, now
			}
			d.mu.Unlock()
			if repeat {
				continue
			}
			var err error
			if b, err = encodeMessage(m); err != nil {
				return
			}
		}
		d.mu.Lock()
		d.digest = b
		d.defs = true // repairs a lost definitions packet
		d.mu.Unlock()
		d.signal()
	}
}
