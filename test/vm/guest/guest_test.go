package guest

import (
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// TestEncryptedOverlay exercises the real path on a kernel with ESP: two
// hosts, an encrypted VNI, containers ping each other through ESP; SA
// counters rise on both sides; the underlay carries ESP and no clear-text
// VXLAN; a key rotation during a continuous ping loses nothing; removing the
// peer removes its SAs and policies and traffic to it is dropped, not sent
// in clear; an empty Desired removes everything.
func TestEncryptedOverlay(t *testing.T) {
	requireESP(t)
	hs := newPair(t, 100)
	capt := nstest.StartCapture(t, hs[1].ns, "eth0", vxlanPort)

	if err := nstest.PingEventually(hs[0].container, hs[1].inner, 10*time.Second); err != nil {
		t.Fatalf("ping through the encrypted overlay: %v", err)
	}
	for i := 0; i < 5; i++ {
		if err := nstest.Ping(hs[1].container, hs[0].inner, time.Second); err != nil {
			t.Fatalf("ping back: %v", err)
		}
	}
	for i, h := range hs {
		st, err := h.prog.Status(h.want)
		if err != nil {
			t.Fatal(err)
		}
		if len(st) != 1 || !st[0].PolicyFound || st[0].SendEpoch != 1 || st[0].SendSA.Packets == 0 || len(st[0].Inbound) != 1 || st[0].Inbound[0].Packets == 0 {
			t.Fatalf("host %d: SA counters did not rise: %+v", i, st)
		}
		t.Logf("host %d: outbound SA spi 0x%08x epoch %d: %d packets; inbound SA spi 0x%08x: %d packets",
			i, st[0].SendSA.SPI, st[0].SendSA.Epoch, st[0].SendSA.Packets, st[0].Inbound[0].SPI, st[0].Inbound[0].Packets)
	}
	time.Sleep(100 * time.Millisecond)
	if capt.ESP() == 0 || capt.Clear() != 0 {
		t.Fatalf("underlay capture: %d ESP, %d clear-text VXLAN packets; want ESP only", capt.ESP(), capt.Clear())
	}
	t.Logf("underlay capture after pings: %d ESP packets, %d clear-text VXLAN packets", capt.ESP(), capt.Clear())

	t.Run("rotation", func(t *testing.T) { rotateDuringPing(t, hs, capt) })
	if t.Failed() {
		return
	}

	// Remove the peer on host 0: its SAs and policies go, the rules stay
	// (the VNI is still encrypted), and traffic to it is dropped.
	before := capt.Clear()
	hs[0].want.Remotes = nil
	if err := hs[0].prog.Apply(hs[0].want); err != nil {
		t.Fatalf("remove peer: %v", err)
	}
	if d := hs[0].prog.Audit(hs[0].want); len(d) != 0 {
		t.Fatalf("audit after removing the peer: %v", d)
	}
	if s, p := ourXfrm(t, hs[0].ns); s != 0 || p != 0 {
		t.Fatalf("after removing the peer host 0 still holds %d SAs and %d policies of ours", s, p)
	}
	c0, _ := hs[0].prog.Counters(hs[0].want)
	if err := nstest.Ping(hs[0].container, hs[1].inner, 500*time.Millisecond); err == nil {
		t.Fatal("ping succeeded after the peer was removed: traffic left without encryption")
	}
	c1, _ := hs[0].prog.Counters(hs[0].want)
	time.Sleep(50 * time.Millisecond)
	if capt.Clear() != before {
		t.Fatalf("clear-text VXLAN reached the underlay after the peer was removed")
	}
	if c1[encryption.ChainOutDrop] <= c0[encryption.ChainOutDrop] {
		t.Fatalf("fail-closed drop counter did not rise (%d -> %d)", c0[encryption.ChainOutDrop], c1[encryption.ChainOutDrop])
	}
	t.Logf("peer removed: 0 SAs, 0 policies; ping fails; %d packets dropped by %s, none in clear",
		c1[encryption.ChainOutDrop]-c0[encryption.ChainOutDrop], encryption.ChainOutDrop)

	// Nothing encrypted any more: everything of ours goes.
	for i, h := range hs {
		if err := h.prog.Apply(encryption.Desired{}); err != nil {
			t.Fatalf("host %d: apply empty: %v", i, err)
		}
		if d := h.prog.Audit(encryption.Desired{}); len(d) != 0 {
			t.Fatalf("host %d: audit after removing everything: %v", i, d)
		}
		if s, p := ourXfrm(t, h.ns); s != 0 || p != 0 {
			t.Fatalf("host %d still holds %d SAs and %d policies", i, s, p)
		}
	}
}

// rotateDuringPing rotates the key (epoch 1 -> 2) with the cluster's state
// machine while host 0's container pings host 1's continuously, and reports
// lost packets (there must be none).
func rotateDuringPing(t *testing.T, hs [2]*host, capt *nstest.Capture) {
	keys := [2]encryption.NodeKeys{{Accept: []uint32{1}, Send: 1, Target: 1}, {Accept: []uint32{1}, Send: 1, Target: 1}}
	clearBefore := capt.Clear()

	var mu sync.Mutex
	sent, lost := 0, 0
	var firstErr error
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			err := nstest.Ping(hs[0].container, hs[1].inner, time.Second)
			mu.Lock()
			sent++
			if err != nil {
				lost++
				if firstErr == nil {
					firstErr = err
				}
			}
			mu.Unlock()
			time.Sleep(10 * time.Millisecond)
		}
	}()

	start := time.Now()
	keys[0] = encryption.StartRotation(keys[0])
	t.Logf("rotation asked on host 0: %v", keys[0])
	steps := 0
	for round := 0; round < 10; round++ {
		changed := false
		for i := range hs {
			next := encryption.Step(keys[i], []encryption.NodeKeys{keys[1-i]})
			if next.Equal(keys[i]) {
				continue
			}
			changed = true
			steps++
			hs[i].want.Accept, hs[i].want.Send = next.Accept, next.Send
			before := hs[i].prog.Stats()
			t0 := time.Now()
			if err := hs[i].prog.Apply(hs[i].want); err != nil {
				t.Fatalf("host %d: apply %v: %v", i, next, err)
			}
			t.Logf("host %d: %v -> %v in %v (%v)", i, keys[i], next, time.Since(t0).Round(time.Microsecond), hs[i].prog.Stats().Sub(before))
			keys[i] = next // advertise only what the kernel holds
			time.Sleep(300 * time.Millisecond)
		}
		if !changed {
			break
		}
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-done
	elapsed := time.Since(start)

	for i, h := range hs {
		if !keys[i].Equal(encryption.NodeKeys{Accept: []uint32{2}, Send: 2, Target: 2}) {
			t.Fatalf("host %d did not converge on epoch 2: %v", i, keys[i])
		}
		if d := h.prog.Audit(h.want); len(d) != 0 {
			t.Fatalf("host %d: audit after rotation: %v", i, d)
		}
		st, _ := h.prog.Status(h.want)
		if len(st) != 1 || st[0].SendEpoch != 2 || st[0].SendSA.Packets == 0 || len(st[0].Inbound) != 1 || st[0].Inbound[0].Epoch != 2 || st[0].Inbound[0].Packets == 0 {
			t.Fatalf("host %d: after rotation the epoch-2 SAs do not carry the traffic: %+v", i, st)
		}
	}
	if capt.Clear() != clearBefore {
		t.Fatalf("clear-text VXLAN on the underlay during rotation")
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("FIGURE: rotation 1->2 in %d steps over %v during continuous ping: %d sent, %d lost", steps, elapsed.Round(time.Millisecond), sent, lost)
	if lost != 0 || sent < 20 {
		t.Fatalf("rotation lost %d of %d pings (first error: %v)", lost, sent, firstErr)
	}
}

// TestRotationCost counts the kernel operations and measures the time of
// each step of a rotation on one host with 10 and 100 remotes.
func TestRotationCost(t *testing.T) {
	requireESP(t)
	for _, n := range []int{10, 100} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			ns := nstest.NewNS(t, "cost")
			p, err := encryption.NewProgrammer(ns.Handle)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			d := encryption.Desired{Local: netip.MustParseAddr("203.0.113.1"), Port: vxlanPort, VNIs: []uint32{100, 200}, Accept: []uint32{1}, Send: 1, Gen: 1, Secret: secret,
				RemoteGens: map[netip.Addr]uint64{}}
			for i := 0; i < n; i++ {
				r := netip.AddrFrom4([4]byte{198, 51, 100, byte(1 + i)})
				d.Remotes = append(d.Remotes, r)
				d.RemoteGens[r] = uint64(1000 + i)
			}
			step := func(name string, accept []uint32, send uint32) {
				d.Accept, d.Send = accept, send
				before := p.Stats()
				t0 := time.Now()
				if err := p.Apply(d); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				el := time.Since(t0)
				st := p.Stats().Sub(before)
				if a := p.Audit(d); len(a) != 0 {
					t.Fatalf("%s: audit: %v", name, a)
				}
				t.Logf("FIGURE: %d remotes, %-22s %v in %v", n, name+":", st, el.Round(time.Microsecond))
			}
			step("initial (epoch 1)", []uint32{1}, 1)
			step("accept new epoch 2", []uint32{1, 2}, 1)
			step("send switch to 2", []uint32{1, 2}, 2)
			step("retire epoch 1", []uint32{2}, 2)
			step("no change (audit)", []uint32{2}, 2)
			d.Remotes = nil
			step("remove all remotes", []uint32{2}, 2)
			if err := p.Apply(encryption.Desired{}); err != nil {
				t.Fatal(err)
			}
			if s, pol := ourXfrm(t, ns); s != 0 || pol != 0 {
				t.Fatalf("left %d SAs, %d policies", s, pol)
			}
		})
	}
}
