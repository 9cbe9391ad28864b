package encryption

import (
	"bytes"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"runtime"
	"runtime/pprof"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/nlbatch"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// benchRemote is the i-th remote VTEP of the benchmarks: IPv6 documentation
// addresses (the IPv4 documentation ranges hold too few hosts). They are
// xfrm selectors in the benchmark's own namespace; nothing is sent.
func benchRemote(i int) netip.Addr {
	return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 1, 14: byte(i >> 8), 15: byte(i)})
}

// benchExtra is the i-th remote added and removed by the benchmarks: a new
// host each time (2001:db8:2::/48), never one whose SA is kept.
func benchExtra(i int) netip.Addr {
	return netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 2, 12: byte(i >> 24), 13: byte(i >> 16), 14: byte(i >> 8), 15: byte(i)})
}

// consoleProfile makes BenchmarkOwnerRemotes write a CPU profile of its
// measured loop to stdout, base64 in lines starting "CPUPROFILE: ": in the
// VM (test/vm, OVERLAYD_VM_BENCH_PROFILE=1) stdout is the serial console,
// the only way out of the guest, and test/vm saves it as a file.
var consoleProfile = flag.Bool("encryption.console-profile", false, "BenchmarkOwnerRemotes: write a CPU profile of the measured loop to stdout (base64)")

// startConsoleProfile starts the CPU profile of consoleProfile, sampling
// at 1 kHz (a benchmark under emulation runs for a few seconds only); the
// returned function stops it and writes it out.
func startConsoleProfile(b *testing.B) func() {
	if !*consoleProfile {
		return func() {}
	}
	var buf bytes.Buffer
	runtime.SetCPUProfileRate(1000)
	if err := pprof.StartCPUProfile(&buf); err != nil {
		b.Fatalf("starting the CPU profile: %v", err)
	}
	return func() {
		pprof.StopCPUProfile()
		enc := base64.StdEncoding.EncodeToString(buf.Bytes())
		for len(enc) > 0 {
			n := min(len(enc), 96)
			fmt.Printf("CPUPROFILE: %s\n", enc[:n])
			enc = enc[n:]
		}
		fmt.Printf("CPUPROFILE-END: %s\n", b.Name())
	}
}

// BenchmarkOwnerRemotes measures what one network's share gaining one
// remote host (a new host's first peer: AddRemotes, as the driver does)
// and losing it again (RemoveRemotes) costs the Owner with n remote hosts
// in place: the whole Update, from the call to the kernel holding the
// result, on a real kernel in a throwaway namespace. Keys are established
// (epoch 1, every remote advertised a generation), so where the kernel has
// ESP (test/vm) each remote has an inbound and an outbound SA besides its
// policy; where it has none, the Owner programs policies and rules only.
//
// The same change made with the share's whole remote list (Update, which
// compares it with the share's) is reported as update-add-ms and
// update-remove-ms.
//
// Reported per add and per remove: milliseconds (wall clock, and the
// process's CPU time, kernel included: less disturbed by other processes
// on a shared machine), kernel dumps (xfrm dumps
// and nftables list requests), kernel requests that change something (an
// nftables transaction counts one) and the round trips (datagrams) that
// carried the xfrm requests: they are batched (nlbatch).
//
// remotes=10-statefile and remotes=1000-statefile are 10 and 1,000 hosts
// with the daemon's state file as the Owner's store, which the others
// leave out: the Owner persists its record before a new outbound SA and
// after the change (the entries of the hosts that changed, see
// persist.go); record-bytes is the whole record's size (its core and
// every entry).
func BenchmarkOwnerRemotes(b *testing.B) {
	nstest.RequireRoot(b)
	for _, c := range []struct {
		n     int
		store bool
	}{{10, false}, {100, false}, {1000, false}, {10, true}, {1000, true}} {
		n := c.n
		name := fmt.Sprintf("remotes=%d", n)
		if c.store {
			name += "-statefile"
		}
		b.Run(name, func(b *testing.B) {
			ns := nstest.NewNS(b, "encbench")
			cfg := OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Tick: time.Hour}
			if c.store {
				// The daemon's state file, in the test's directory
				// (a disk or tmpfs: wherever TMPDIR is).
				st, err := statefile.Open(b.TempDir())
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { st.Close() })
				cfg.Store = st
			}
			o, err := NewOwner(cfg)
			if err != nil {
				b.Fatal(err)
			}
			o.notify = false
			b.Cleanup(o.Close)
			local := netip.MustParseAddr("2001:db8::a")
			remotes := make([]netip.Addr, n)
			for i := range remotes {
				remotes[i] = benchRemote(i + 1)
			}
			o.mu.Lock()
			o.led.keys = NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}
			for i, r := range remotes {
				o.led.remoteGens[r] = uint64(1000 + i)
			}
			o.mu.Unlock()
			if err := o.SetLocal(local); err != nil {
				b.Fatal(err)
			}
			// Another network's clear VNI, so both sets are in use.
			if err := o.Update(2, Share{VNIs: []uint32{200}}, false); err != nil {
				b.Fatal(err)
			}
			share := Share{VNIs: []uint32{100}, Encrypted: true, Remotes: remotes}
			okOrUnsupported(b, "initial share", o.Update(1, share, false))
			// The first update found no ESP here and fell back to no SAs;
			// settle that before measuring.
			okOrUnsupported(b, "initial share again", o.Update(1, share, false))
			if a := o.Audit(); len(a) != 0 {
				b.Fatalf("audit before the benchmark: %v", a[:min(len(a), 5)])
			}
			var addDur, delDur, addCPU, delCPU, upAddDur, upDelDur time.Duration
			var addStats, delStats, upStats Stats
			stopProfile := startConsoleProfile(b)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				extra := benchExtra(2*i + 1)
				o.mu.Lock()
				o.led.remoteGens[extra] = uint64(5000 + i)
				o.mu.Unlock()
				// The driver's way: the change alone (AddRemotes before
				// the peers are programmed, RemoveRemotes after).
				s0 := o.prog.Stats()
				c0, t0 := cpuTime(), time.Now()
				err := o.AddRemotes(1, extra)
				addDur += time.Since(t0)
				addCPU += cpuTime() - c0
				s1 := o.prog.Stats()
				okOrUnsupported(b, "add a remote", err)
				c1, t1 := cpuTime(), time.Now()
				err = o.RemoveRemotes(1, extra)
				delDur += time.Since(t1)
				delCPU += cpuTime() - c1
				okOrUnsupported(b, "remove a remote", err)
				s2 := o.prog.Stats()
				addStats = addStats.Sub(Stats{}.Sub(s1.Sub(s0))) // +=
				delStats = delStats.Sub(Stats{}.Sub(s2.Sub(s1)))
				// The whole list instead (Update): the share's remotes
				// are compared with the list the caller passes.
				extra = benchExtra(2*i + 2)
				o.mu.Lock()
				o.led.remoteGens[extra] = uint64(5000 + i)
				o.mu.Unlock()
				plus := share
				plus.Remotes = append(slices.Clip(remotes), extra)
				s3 := o.prog.Stats()
				t2 := time.Now()
				err = o.Update(1, plus, false)
				upAddDur += time.Since(t2)
				okOrUnsupported(b, "add a remote by Update", err)
				t3 := time.Now()
				err = o.Update(1, share, false)
				upDelDur += time.Since(t3)
				okOrUnsupported(b, "remove a remote by Update", err)
				upStats = upStats.Sub(Stats{}.Sub(o.prog.Stats().Sub(s3)))
			}
			b.StopTimer()
			stopProfile()
			if a := o.Audit(); len(a) != 0 {
				b.Fatalf("audit after the benchmark: %v", a[:min(len(a), 5)])
			}
			rawAdd, rawDel, batchAdd, batchDel := rawRemoteCost(b, ns, o, b.N)
			per := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(b.N) }
			count := func(v int) float64 { return float64(v) / float64(b.N) }
			b.ReportMetric(per(addDur), "add-ms")
			b.ReportMetric(per(delDur), "remove-ms")
			b.ReportMetric(per(addCPU), "add-cpu-ms")
			b.ReportMetric(per(delCPU), "remove-cpu-ms")
			b.ReportMetric(count(addStats.XfrmDumps+addStats.NftDumps), "add-dumps")
			b.ReportMetric(count(delStats.XfrmDumps+delStats.NftDumps), "remove-dumps")
			b.ReportMetric(count(addStats.Changes()), "add-requests")
			b.ReportMetric(count(delStats.Changes()), "remove-requests")
			b.ReportMetric(count(addStats.XfrmSends), "add-round-trips")
			b.ReportMetric(count(delStats.XfrmSends), "remove-round-trips")
			b.ReportMetric(count(addStats.XfrmSends), "add-round-trips")
			b.ReportMetric(count(delStats.XfrmSends), "remove-round-trips")
			b.ReportMetric(per(upAddDur), "update-add-ms")
			b.ReportMetric(per(upDelDur), "update-remove-ms")
			b.ReportMetric(count(upStats.XfrmDumps+upStats.NftDumps), "update-dumps")
			if c.store {
				o.mu.Lock()
				size := len(o.led.savedCore)
				for _, e := range o.led.savedRemotes {
					size += len(e)
				}
				b.ReportMetric(float64(size), "record-bytes")
				o.mu.Unlock()
			}
			b.ReportMetric(per(rawAdd), "raw-add-ms")
			b.ReportMetric(per(rawDel), "raw-remove-ms")
			b.ReportMetric(per(batchAdd), "raw-batch-add-ms")
			b.ReportMetric(per(batchDel), "raw-batch-remove-ms")
		})
	}
}

// rawRemoteCost is the kernel's own share of the benchmark: the requests
// an added remote needs (its inbound and outbound SA where the kernel has
// ESP, its policy), sent directly, one netlink request each, with the
// Owner's n remotes in place (the Owner is idle: no loop), then removed
// again; rounds times. Nothing else is done, so this is the least an
// overlayd Update could cost with a round trip per request. batchAdd and
// batchDel are the same requests sent together (nlbatch: the adds in
// one datagram, the removal's policy then its SAs in two, as the Owner
// sends them): the least it can cost now.
func rawRemoteCost(b *testing.B, ns *nstest.NS, o *Owner, rounds int) (add, del, batchAdd, batchDel time.Duration) {
	b.Helper()
	h, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_XFRM)
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	xb, err := nlbatch.OpenXfrm(ns.Handle)
	if err != nil {
		b.Fatal(err)
	}
	defer xb.Close()
	o.mu.Lock()
	d := o.desiredLocked()
	o.mu.Unlock()
	var batch nlbatch.XfrmBatch
	send := func(what string) {
		errs, _ := xb.Send(&batch)
		batch.Reset()
		if err := errors.Join(errs...); err != nil {
			b.Fatalf("%s: %v", what, err)
		}
	}
	for i := 0; i < 2*rounds; i++ {
		r := benchExtra(1<<20 + i)
		d := d
		d.Remotes, d.RemoteGens = []netip.Addr{r}, map[netip.Addr]uint64{r: 7}
		dx, err := xfrmOf(&d)
		if err != nil {
			b.Fatal(err)
		}
		var states []*netlink.XfrmState
		for _, w := range dx.states {
			states = append(states, w.netlink(d.Port))
		}
		k := remoteKey(d.Local, r, d.Port)
		pol := k.netlink(dx.policies[k], d.Local)
		if i%2 == 1 {
			t0 := time.Now()
			for _, s := range states {
				if err := batch.AddState(s); err != nil {
					b.Fatal(err)
				}
			}
			if err := batch.SetPolicy(pol, false); err != nil {
				b.Fatal(err)
			}
			send("batched add")
			batchAdd += time.Since(t0)
			t0 = time.Now()
			batch.DelPolicy(pol)
			send("batched policy delete")
			for _, s := range states {
				batch.DelState(s)
			}
			if len(states) > 0 {
				send("batched SA delete")
			}
			batchDel += time.Since(t0)
			continue
		}
		t0 := time.Now()
		for _, s := range states {
			if err := h.XfrmStateAdd(s); err != nil {
				b.Fatal(err)
			}
		}
		if err := h.XfrmPolicyAdd(pol); err != nil {
			b.Fatal(err)
		}
		add += time.Since(t0)
		t0 = time.Now()
		if err := h.XfrmPolicyDel(pol); err != nil {
			b.Fatal(err)
		}
		for _, s := range states {
			if err := h.XfrmStateDel(s); err != nil {
				b.Fatal(err)
			}
		}
		del += time.Since(t0)
	}
	return add, del, batchAdd, batchDel
}

// cpuTime is the CPU time the process used so far (user and system).
func cpuTime() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkDeriveSA is the derivation of one SA's SPI and key: one-shot,
// as the specification states it (hkdf.Key: extract, then expand, for each
// of the two), and as the Programmer's cache does it (deriver: the
// extraction once per secret, the expansion with an HMAC keyed once).
// Both give the same bytes (TestDerivationIsOneShotHKDF).
func BenchmarkDeriveSA(b *testing.B) {
	b.Run("one-shot", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if _, err := SPI(testSecret, hostA, hostB, 1, uint64(i)); err != nil {
				b.Fatal(err)
			}
			if _, err := SAKey(testSecret, hostA, hostB, 1, uint64(i)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("keyed", func(b *testing.B) {
		b.ReportAllocs()
		d, err := newDeriver(testSecret)
		if err != nil {
			b.Fatal(err)
		}
		for i := 0; i < b.N; i++ {
			if _, _, err := d.sa(hostA, hostB, 1, uint64(i)); err != nil {
				b.Fatal(err)
			}
		}
	})
}
