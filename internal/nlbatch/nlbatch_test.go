package nlbatch

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

func TestOpString(t *testing.T) {
	mac := [6]byte{0x02, 0x42, 0xc0, 0, 2, 5}
	for _, tc := range []struct {
		op   Op
		want string
	}{
		{neighSet(7, netip.MustParseAddr("192.0.2.5"), mac), "neigh set 192.0.2.5 lladdr 02:42:c0:00:02:05 on ifindex 7"},
		{neighDel(7, netip.MustParseAddr("2001:db8::5")), "neigh del 2001:db8::5 on ifindex 7"},
		{fdbSet(7, mac, netip.MustParseAddr("198.51.100.1")), "fdb set 02:42:c0:00:02:05 dst 198.51.100.1 self on ifindex 7"},
		{fdbDel(7, mac, netip.MustParseAddr("198.51.100.1")), "fdb del 02:42:c0:00:02:05 dst 198.51.100.1 self on ifindex 7"},
		{Op{Kind: NeighSet, LinkIndex: 3}, "neigh set <no address> lladdr 00:00:00:00:00:00 on ifindex 3"},
		{Op{Kind: 9, LinkIndex: 3}, "kind(9) ip <no address> lladdr 00:00:00:00:00:00 vtep <no address> on ifindex 3"},
	} {
		if got := tc.op.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
}

func TestValidate(t *testing.T) {
	ip := netip.MustParseAddr("192.0.2.1")
	vtep := netip.MustParseAddr("203.0.113.1")
	for _, tc := range []struct {
		op Op
		ok bool
	}{
		{neighSet(1, ip, [6]byte{}), true},
		{neighDel(1, netip.MustParseAddr("2001:db8::1")), true},
		{neighSet(1, netip.MustParseAddr("::ffff:192.0.2.1"), [6]byte{}), true},
		{fdbSet(1, [6]byte{}, vtep), true},
		{fdbDel(1, [6]byte{}, vtep), true},
		{neighSet(1, netip.Addr{}, [6]byte{}), false},
		{neighSet(1, netip.MustParseAddr("0.0.0.0"), [6]byte{}), false},
		{neighDel(1, netip.MustParseAddr("::")), false},
		{neighSet(0, ip, [6]byte{}), false},
		{neighSet(-3, ip, [6]byte{}), false},
		{neighSet(1<<40, ip, [6]byte{}), false},
		{fdbSet(1, [6]byte{}, netip.Addr{}), false},
		{fdbDel(1, [6]byte{}, netip.Addr{}), false},
		{Op{Kind: 0, LinkIndex: 1, IP: ip, VTEP: vtep}, false},
		{Op{Kind: FDBDel + 1, LinkIndex: 1, IP: ip, VTEP: vtep}, false},
	} {
		_, _, err := tc.op.normalize()
		if (err == nil) != tc.ok {
			t.Errorf("%v: validation error %v, want ok=%v", tc.op, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidOp) {
			t.Errorf("%v: error %v does not wrap ErrInvalidOp", tc.op, err)
		}
	}
}

func TestErrorMessage(t *testing.T) {
	ip := netip.MustParseAddr("192.0.2.5")
	e := &Error{Total: 20000}
	for i := range 7 {
		e.Failed = append(e.Failed, OpError{Index: i, Op: neighSet(7, ip, [6]byte{2, 0x42}), Err: unix.EINVAL})
	}
	msg := e.Error()
	if !strings.HasPrefix(msg, "7 of 20000 netlink operations failed: neigh set 192.0.2.5 lladdr 02:42:00:00:00:00 on ifindex 7: invalid argument; ") {
		t.Errorf("unexpected message %q", msg)
	}
	if !strings.HasSuffix(msg, "; and 2 more") || strings.Count(msg, "invalid argument") != 5 {
		t.Errorf("message does not cap the listed failures at 5: %q", msg)
	}
	if !errors.Is(e, unix.EINVAL) {
		t.Errorf("errors.Is(EINVAL) = false")
	}
}

func TestOpenInvalidNamespace(t *testing.T) {
	if c, err := Open(netns.None()); err == nil {
		c.Close()
		t.Fatal("Open(netns.None()) succeeded")
	}
}

// TestSetAndDump programs neighbours (IPv4 and IPv6) and FDB entries and
// checks that a dump shows exactly those.
func TestSetAndDump(t *testing.T) {
	e := newEnv(t, envOpts{})
	const n = 1000 // numV4 IPv4 neighbours, the rest IPv6
	ops := peerOps(e.link, 0, n, peerIP, vtep4)
	mustApply(t, e.conn, ops)
	neigh, fdb := stateOf(ops)
	e.wantState(t, neigh, fdb)

	// Applying the same again is idempotent.
	mustApply(t, e.conn, ops)
	e.wantState(t, neigh, fdb)
}

// TestIPv6Underlay programs FDB entries with IPv6 VTEPs on a VXLAN of the
// IPv6 family, and checks that an IPv4 VXLAN refuses IPv6 VTEPs per op.
func TestIPv6Underlay(t *testing.T) {
	e := newEnv(t, envOpts{v6Underlay: true})
	ops := peerOps(e.link, 0, 300, peerIP6, vtep6)
	mustApply(t, e.conn, ops)
	neigh, fdb := stateOf(ops)
	e.wantState(t, neigh, fdb)

	e4 := newEnv(t, envOpts{})
	ops4 := []Op{
		fdbSet(e4.link, peerMAC(1), vtep4(1)),
		fdbSet(e4.link, peerMAC(2), vtep6(2)), // wrong family for this link
		fdbSet(e4.link, peerMAC(3), vtep4(3)),
	}
	err := e4.conn.Apply(ops4)
	if got := failedIndexes(t, err); !slices.Equal(got, []int{1}) {
		t.Fatalf("failed indexes %v, want [1] (error %v)", got, err)
	}
	var errno unix.Errno
	if !errors.As(err, &errno) {
		t.Errorf("error %v carries no errno", err)
	}
	t.Logf("IPv6 VTEP on an IPv4 VXLAN: %v", err)
	_, fdb4 := stateOf([]Op{ops4[0], ops4[2]})
	e4.wantState(t, map[netip.Addr][6]byte{}, fdb4)
}

func TestReplace(t *testing.T) {
	e := newEnv(t, envOpts{})
	ip := peerIP(1)
	ip6 := peerIP6(1)
	mac := peerMAC(1)
	mustApply(t, e.conn, []Op{
		neighSet(e.link, ip, mac),
		neighSet(e.link, ip6, mac),
		fdbSet(e.link, mac, vtep4(1)),
	})
	e.wantState(t, map[netip.Addr][6]byte{ip: mac, ip6: mac}, map[[6]byte]netip.Addr{mac: vtep4(1)})

	// Another VTEP for the MAC, another MAC for the IPs: replaced.
	mac2 := peerMAC(2)
	mustApply(t, e.conn, []Op{
		fdbSet(e.link, mac, vtep4(2)),
		neighSet(e.link, ip, mac2),
		neighSet(e.link, ip6, mac2),
	})
	e.wantState(t, map[netip.Addr][6]byte{ip: mac2, ip6: mac2}, map[[6]byte]netip.Addr{mac: vtep4(2)})

	// Both in one batch: the later one wins.
	mustApply(t, e.conn, []Op{
		fdbSet(e.link, mac, vtep4(3)),
		fdbSet(e.link, mac, vtep4(4)),
	})
	e.wantState(t, map[netip.Addr][6]byte{ip: mac2, ip6: mac2}, map[[6]byte]netip.Addr{mac: vtep4(4)})
}

func TestDelete(t *testing.T) {
	e := newEnv(t, envOpts{})
	ops := peerOps(e.link, 0, 10, peerIP, vtep4)
	ops = append(ops, peerOps(e.link, 1000, 1010, peerIP6, vtep4)...)
	mustApply(t, e.conn, ops)
	neigh, fdb := stateOf(ops)
	e.wantState(t, neigh, fdb)

	// FDBDel with a VTEP that is not the entry's deletes nothing, and the
	// kernel does not call that an error.
	wrong := fdbDel(e.link, peerMAC(0), vtep4(77))
	if err := e.conn.Apply([]Op{wrong}); err != nil {
		t.Logf("FDBDel with a non-matching VTEP: %v", err)
	}
	e.wantState(t, neigh, fdb)

	// Deleting half of them with the right VTEP.
	del := append(delOps(e.link, 0, 5, peerIP, vtep4), delOps(e.link, 1000, 1005, peerIP6, vtep4)...)
	mustApply(t, e.conn, del)
	neigh, fdb = stateOf(append(slices.Clone(ops), del...))
	e.wantState(t, neigh, fdb)

	// Deleting them again (absent now) succeeds, and so do deletes of
	// entries that never existed.
	mustApply(t, e.conn, del)
	mustApply(t, e.conn, delOps(e.link, 500, 520, peerIP, vtep4))
	e.wantState(t, neigh, fdb)

	// Delete the rest.
	mustApply(t, e.conn, append(delOps(e.link, 5, 10, peerIP, vtep4), delOps(e.link, 1005, 1010, peerIP6, vtep4)...))
	e.wantState(t, map[netip.Addr][6]byte{}, map[[6]byte]netip.Addr{})
}

// TestPerOpErrors checks that failures are attributed to exactly the ops
// that caused them, that the rest are applied, and that invalid ops are
// reported without being sent.
func TestPerOpErrors(t *testing.T) {
	e := newEnv(t, envOpts{})
	ops := peerOps(e.link, 0, 1000, peerIP, vtep4) // 2,000 ops
	bad := []int{0, 1, 7, 510, 511, 512, 513, 1023, 1024, 1500, 1998, 1999}
	for _, i := range bad {
		ops[i].LinkIndex = badIfindex
	}
	invalid := map[int]Op{
		3:    neighSet(e.link, netip.Addr{}, peerMAC(1)),                        // zero IP
		600:  fdbSet(e.link, peerMAC(300), netip.Addr{}),                        // zero VTEP
		900:  neighSet(0, peerIP(450), peerMAC(450)),                            // no link
		1200: {Kind: 0, LinkIndex: e.link, IP: peerIP(600), VTEP: vtep4(600)},   // no kind
		1700: neighDel(e.link, netip.MustParseAddr("0.0.0.0")),                  // unspecified
		1701: {Kind: 42, LinkIndex: e.link, IP: peerIP(850), MAC: peerMAC(850)}, // unknown kind
	}
	for i, op := range invalid {
		ops[i] = op
	}

	err := e.conn.Apply(ops)
	var want []int
	for i := range ops {
		if _, ok := invalid[i]; ok || slices.Contains(bad, i) {
			want = append(want, i)
		}
	}
	got := failedIndexes(t, err)
	if !slices.Equal(got, want) {
		t.Fatalf("failed indexes\n got %v\nwant %v", got, want)
	}
	var ae *Error
	errors.As(err, &ae)
	if ae.Total != len(ops) {
		t.Errorf("Total = %d, want %d", ae.Total, len(ops))
	}
	for _, f := range ae.Failed {
		if f.Op != ops[f.Index] {
			t.Errorf("failure %d lists op %v, want %v", f.Index, f.Op, ops[f.Index])
		}
		if _, inv := invalid[f.Index]; inv {
			if !errors.Is(f.Err, ErrInvalidOp) {
				t.Errorf("op %d: %v, want ErrInvalidOp", f.Index, f.Err)
			}
		} else if !errors.Is(f.Err, unix.ENODEV) {
			t.Errorf("op %d: %v, want ENODEV", f.Index, f.Err)
		}
	}
	if !errors.Is(err, unix.ENODEV) || !errors.Is(err, ErrInvalidOp) {
		t.Errorf("errors.Is on %v does not find ENODEV and ErrInvalidOp", err)
	}
	t.Logf("%v", err)

	var applied []Op
	for i, op := range ops {
		if !slices.Contains(want, i) {
			applied = append(applied, op)
		}
	}
	neigh, fdb := stateOf(applied)
	e.wantState(t, neigh, fdb)
}

// TestBatchBoundaries applies batches around the batch size and checks that
// replies are matched to the right ops at the boundaries.
func TestBatchBoundaries(t *testing.T) {
	for _, size := range []int{1, 511, 512, 513, 5000} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			e := newEnv(t, envOpts{})
			if got := e.conn.BatchSize(); got != DefaultBatchSize {
				t.Fatalf("BatchSize() = %d, want %d", got, DefaultBatchSize)
			}
			ops := make([]Op, size)
			for i := range ops {
				ops[i] = fdbSet(e.link, peerMAC(i), vtep4(i))
			}
			// Clean run.
			mustApply(t, e.conn, ops)
			_, fdb := stateOf(ops)
			e.wantState(t, map[netip.Addr][6]byte{}, fdb)
			mustApply(t, e.conn, fdbDelsOf(ops))
			e.wantState(t, map[netip.Addr][6]byte{}, map[[6]byte]netip.Addr{})

			// Failures at the first and last message of batches.
			var bad []int
			for _, i := range []int{0, 510, 511, 512, 513, 1023, 1024, size - 1} {
				if i >= 0 && i < size && !slices.Contains(bad, i) {
					bad = append(bad, i)
					ops[i].LinkIndex = badIfindex
				}
			}
			slices.Sort(bad)
			got := failedIndexes(t, e.conn.Apply(ops))
			if !slices.Equal(got, bad) {
				t.Fatalf("failed indexes %v, want %v", got, bad)
			}
			var good []Op
			for i, op := range ops {
				if !slices.Contains(bad, i) {
					good = append(good, op)
				}
			}
			_, fdb = stateOf(good)
			e.wantState(t, map[netip.Addr][6]byte{}, fdb)
		})
	}
}

func fdbDelsOf(ops []Op) []Op {
	del := make([]Op, len(ops))
	for i, o := range ops {
		del[i] = fdbDel(o.LinkIndex, o.MAC, o.VTEP)
	}
	return del
}

// TestBatchSizes runs the same work with other batch sizes, including one
// message per sendto and more messages than the default.
func TestBatchSizes(t *testing.T) {
	e := newEnv(t, envOpts{})
	for _, bs := range []int{1, 7, 4096, 0} {
		e.conn.SetBatchSize(bs)
		ops := peerOps(e.link, 0, 2500, peerIP, vtep4)
		ops[2*1000].LinkIndex = badIfindex
		got := failedIndexes(t, e.conn.Apply(ops))
		if !slices.Equal(got, []int{2000}) {
			t.Fatalf("batch size %d: failed indexes %v, want [2000]", bs, got)
		}
		good := slices.Delete(slices.Clone(ops), 2000, 2001)
		neigh, fdb := stateOf(good)
		e.wantState(t, neigh, fdb)
		mustApply(t, e.conn, delOps(e.link, 0, 2500, peerIP, vtep4))
		e.wantState(t, map[netip.Addr][6]byte{}, map[[6]byte]netip.Addr{})
	}
	if got := e.conn.BatchSize(); got != DefaultBatchSize {
		t.Errorf("SetBatchSize(0) left BatchSize() = %d, want %d", got, DefaultBatchSize)
	}
}

// TestConcurrentApply applies from several goroutines on one Conn.
func TestConcurrentApply(t *testing.T) {
	e := newEnv(t, envOpts{})
	const workers, per = 4, 700
	var wg sync.WaitGroup
	var all []Op
	for w := range workers {
		ops := peerOps(e.link, 1000+w*per, 1000+(w+1)*per, peerIP6, vtep4)
		ops[5].LinkIndex = badIfindex
		all = append(all, slices.Delete(slices.Clone(ops), 5, 6)...)
		wg.Go(func() {
			for range 3 {
				err := e.conn.Apply(ops)
				var ae *Error
				if !errors.As(err, &ae) || len(ae.Failed) != 1 || ae.Failed[0].Index != 5 {
					t.Errorf("worker %d: %v, want op 5 to fail", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	neigh, fdb := stateOf(all)
	e.wantState(t, neigh, fdb)

	for w := range workers {
		wg.Go(func() {
			mustApplyNoFatal(t, e.conn, delOps(e.link, 1000+w*per, 1000+(w+1)*per, peerIP6, vtep4))
		})
	}
	wg.Wait()
	e.wantState(t, map[netip.Addr][6]byte{}, map[[6]byte]netip.Addr{})
}

func mustApplyNoFatal(t *testing.T, c *Conn, ops []Op) {
	if err := c.Apply(ops); err != nil {
		t.Errorf("Apply: %v", err)
	}
}

// TestLostReplies shrinks the receive buffer so that error replies overflow
// it (ENOBUFS): Apply must not claim success for ops whose replies were
// lost, and the Conn must work normally afterwards.
func TestLostReplies(t *testing.T) {
	e := newEnv(t, envOpts{})
	c := e.conn
	if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 0); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.maxBatch = 1 << 20 // do not let the small buffer cap the batch
	c.mu.Unlock()
	c.SetBatchSize(2000)

	// Every other op fails.
	ops := make([]Op, 2000)
	for i := range ops {
		ops[i] = fdbSet(e.link, peerMAC(i), vtep4(i))
		if i%2 == 1 {
			ops[i].LinkIndex = badIfindex
		}
	}
	err := c.Apply(ops)
	var ae *Error
	if !errors.As(err, &ae) {
		t.Fatalf("Apply with overflowing replies: %v, want *Error", err)
	}
	if !errors.Is(err, ErrResultUnknown) || !errors.Is(err, unix.ENOBUFS) {
		t.Fatalf("Apply with overflowing replies: %v, want ErrResultUnknown and ENOBUFS", err)
	}
	failed := map[int]error{}
	unknown := 0
	for _, f := range ae.Failed {
		failed[f.Index] = f.Err
		if errors.Is(f.Err, ErrResultUnknown) {
			unknown++
		} else if !errors.Is(f.Err, unix.ENODEV) {
			t.Errorf("op %d: unexpected error %v", f.Index, f.Err)
		}
	}
	for i := 1; i < len(ops); i += 2 {
		if _, ok := failed[i]; !ok {
			t.Fatalf("op %d failed in the kernel but Apply did not report it", i)
		}
	}
	t.Logf("%d failures reported, %d of them unknown: %.200s", len(ae.Failed), unknown, err)

	// Ops that were not reported as failed are in the kernel.
	fdb := e.fdb(t)
	for i := 0; i < len(ops); i += 2 {
		if _, reported := failed[i]; !reported {
			if fdb[ops[i].MAC] != ops[i].VTEP {
				t.Errorf("op %d was not reported as failed but is not in the kernel", i)
			}
		}
	}

	// Back to normal: the Conn still works.
	if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, wantRcvBuf); err != nil {
		t.Fatal(err)
	}
	c.SetBatchSize(0)
	good := make([]Op, 0, 1000)
	for i := 0; i < len(ops); i += 2 {
		good = append(good, ops[i])
	}
	mustApply(t, c, good)
	_, want := stateOf(good)
	e.wantState(t, map[netip.Addr][6]byte{}, want)
}

func TestClosed(t *testing.T) {
	e := newEnv(t, envOpts{})
	if err := e.conn.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.conn.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	ops := peerOps(e.link, 0, 3, peerIP, vtep4)
	err := e.conn.Apply(ops)
	if got := failedIndexes(t, err); len(got) != len(ops) || !errors.Is(err, ErrClosed) {
		t.Errorf("Apply on closed Conn: %v", err)
	}
	if err := e.conn.Apply(nil); err != nil {
		t.Errorf("Apply(nil) on closed Conn: %v", err)
	}
}

func TestEmptyApply(t *testing.T) {
	e := newEnv(t, envOpts{})
	if err := e.conn.Apply(nil); err != nil {
		t.Fatal(err)
	}
	got := failedIndexes(t, e.conn.Apply([]Op{{}}))
	if !slices.Equal(got, []int{0}) {
		t.Fatalf("failed %v", got)
	}
}

// TestStaleReplies leaves replies of earlier requests (an error, an ACK and
// one with a sequence number far ahead) in the socket's queue: Apply must
// ignore them.
func TestStaleReplies(t *testing.T) {
	e := newEnv(t, envOpts{})
	c := e.conn
	c.mu.Lock()
	bad := fdbSet(badIfindex, peerMAC(1), vtep4(1))
	ip, vtep, _ := bad.normalize()
	stamped := func(seq uint32, ack uint16) []byte {
		m := c.appendMsg(nil, &bad, ip, vtep)
		putHdr(m, uint32(len(m)), unix.RTM_NEWNEIGH, binary.NativeEndian.Uint16(m[6:])|ack, seq, c.portID)
		return m
	}
	msg := stamped(c.nextSeq(), unix.NLM_F_ACK)
	future := stamped(c.seq+1_000_000, 0)
	for _, m := range [][]byte{msg, c.probe(c.nextSeq()), future} {
		if err := c.send(m); err != nil {
			c.mu.Unlock()
			t.Fatal(err)
		}
	}
	c.mu.Unlock()

	ops := peerOps(e.link, 0, 600, peerIP, vtep4)
	mustApply(t, c, ops)
	neigh, fdb := stateOf(ops)
	e.wantState(t, neigh, fdb)
}

// TestAllocs checks that Apply does not allocate per op.
func TestAllocs(t *testing.T) {
	e := newEnv(t, envOpts{})
	ops := peerOps(e.link, 0, 2000, peerIP6, vtep4) // 4,000 ops, 8 batches
	mustApply(t, e.conn, ops)                       // grow the buffers
	allocs := testing.AllocsPerRun(5, func() {
		if err := e.conn.Apply(ops); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("%.0f allocations per Apply of %d ops", allocs, len(ops))
	if allocs > 40 {
		t.Errorf("%.0f allocations per Apply of %d ops, want a few per batch at most", allocs, len(ops))
	}
}
