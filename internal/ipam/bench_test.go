package ipam

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/statefile"
)

// Benchmarks run on the real state file (bbolt, fsync per write) in a
// temporary directory. Pools in 127/8 are bookkeeping only: no address of
// them is ever used for traffic.

func pctl(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

func reportLatency(b *testing.B, d []time.Duration) {
	b.ReportMetric(float64(pctl(d, 50).Microseconds()), "p50-µs")
	b.ReportMetric(float64(pctl(d, 99).Microseconds()), "p99-µs")
}

func openBenchStore(b *testing.B) *statefile.File {
	b.Helper()
	sf, err := statefile.Open(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { sf.Close() })
	return sf
}

// single starts an allocator alone in its cluster (it claims by itself).
func single(b *testing.B, store Store) *Allocator {
	b.Helper()
	a, err := newAllocator(Config{NodeName: "bench-a", Store: store, Logger: slog.New(slog.DiscardHandler)}, defaultTiming)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(a.Close)
	n := newFakeNet()
	n.nodes["bench-a"] = a
	a.SetTransport(&fakeTransport{net: n, name: "bench-a", joined: true})
	return a
}

// BenchmarkLocalAllocation: RequestAddress with free space owned, one at a
// time (each pays its fsync) and 32 at once (they share writes); and one
// at a time with a store that writes nothing (the allocator's own cost).
func BenchmarkLocalAllocation(b *testing.B) {
	for _, tc := range []struct {
		name string
		conc int
		disk bool
	}{{"statefile/concurrent=1", 1, true}, {"statefile/concurrent=32", 32, true}, {"nostore/concurrent=1", 1, false}} {
		b.Run(tc.name, func(b *testing.B) {
			conc := tc.conc
			var store Store = discardStore{}
			if tc.disk {
				store = openBenchStore(b)
			}
			a := single(b, store)
			ctx := context.Background()
			r, err := a.RequestPool(ctx, PoolRequest{Pool: "127.64.0.0/10"})
			if err != nil {
				b.Fatal(err)
			}
			var mu sync.Mutex
			var lat []time.Duration
			next := make(chan int)
			var wg sync.WaitGroup
			for range conc {
				wg.Go(func() {
					for i := range next {
						start := time.Now()
						_, err := a.RequestAddress(ctx, AddressRequest{PoolID: r.PoolID, Options: map[string]string{OptionMACAddress: mac(i>>16, i&0xffff)}})
						d := time.Since(start)
						if err != nil {
							b.Error(err)
							return
						}
						mu.Lock()
						lat = append(lat, d)
						mu.Unlock()
					}
				})
			}
			i := 0
			for b.Loop() {
				next <- i
				i++
			}
			close(next)
			wg.Wait()
			reportLatency(b, lat)
		})
	}
}

// tcpNet connects allocators over TCP on loopback (length-prefixed frames
// on one connection per pair): the network part without memberlist.
type tcpNet struct {
	mu    *lockorder.Mutex
	addrs map[string]string   // guarded by mu
	conns map[string]net.Conn // by "from>to"; guarded by mu
	lns   []net.Listener      // guarded by mu
}

type tcpTransport struct {
	n    *tcpNet
	name string
	wmu  *lockorder.Mutex // serialises writes of this node
}

func (n *tcpNet) listen(b *testing.B, name, ip string, a *Allocator) {
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		b.Fatal(err)
	}
	n.mu.Lock()
	n.addrs[name] = ln.Addr().String()
	n.lns = append(n.lns, ln)
	n.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				r := bufio.NewReader(c)
				var hdr [4]byte
				if _, err := io.ReadFull(r, hdr[:]); err != nil {
					return
				}
				from := make([]byte, binary.BigEndian.Uint32(hdr[:]))
				if _, err := io.ReadFull(r, from); err != nil {
					return
				}
				for {
					if _, err := io.ReadFull(r, hdr[:]); err != nil {
						return
					}
					p := make([]byte, binary.BigEndian.Uint32(hdr[:]))
					if _, err := io.ReadFull(r, p); err != nil {
						return
					}
					a.HandleMessage(string(from), p)
				}
			}()
		}
	}()
}

func (n *tcpNet) close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, ln := range n.lns {
		ln.Close()
	}
	for _, c := range n.conns {
		c.Close()
	}
}

func frame(p []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(p))), p...)
}

func (t *tcpTransport) Send(node string, payload []byte) error {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	key := t.name + ">" + node
	t.n.mu.Lock()
	c, addr := t.n.conns[key], t.n.addrs[node]
	t.n.mu.Unlock()
	if c == nil {
		var err error
		if c, err = net.Dial("tcp", addr); err != nil {
			return err
		}
		if _, err := c.Write(frame([]byte(t.name))); err != nil {
			return err
		}
		t.n.mu.Lock()
		t.n.conns[key] = c
		t.n.mu.Unlock()
	}
	_, err := c.Write(frame(payload))
	return err
}

func (t *tcpTransport) Members() []Member {
	t.n.mu.Lock()
	defer t.n.mu.Unlock()
	var out []Member
	for _, name := range sortedKeys(t.n.addrs) {
		if name != t.name {
			out = append(out, Member{Name: name, State: Alive})
		}
	}
	return out
}

func (t *tcpTransport) Joined() bool { return true }

// BenchmarkObtainFromAnotherHost: a host with no space in a pool asks for
// an address; the owner gives half its free space over TCP on loopback;
// both write to their state files. Each iteration uses a new pool, created
// (claimed by the owner, learnt by the other) outside the timing.
func BenchmarkObtainFromAnotherHost(b *testing.B) {
	n := &tcpNet{mu: lockorder.New(lockorder.LevelLeaf), addrs: map[string]string{}, conns: map[string]net.Conn{}}
	defer n.close()
	var as []*Allocator
	for i, name := range []string{"bench-a", "bench-b"} {
		a, err := newAllocator(Config{NodeName: name, Store: openBenchStore(b), Logger: slog.New(slog.DiscardHandler)}, defaultTiming)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(a.Close)
		n.listen(b, name, fmt.Sprintf("127.0.0.%d", 71+i), a)
		as = append(as, a)
	}
	for _, a := range as {
		a.SetTransport(&tcpTransport{n: n, name: a.self.Name, wmu: lockorder.New(lockorder.LevelLeaf)})
	}
	owner, asker := as[0], as[1]
	ctx := context.Background()
	var lat []time.Duration
	i := 0
	for b.Loop() {
		b.StopTimer()
		pool := fmt.Sprintf("127.%d.%d.0/24", 100+i/256, i%256)
		i++
		r, err := owner.RequestPool(ctx, PoolRequest{Pool: pool})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := asker.RequestPool(ctx, PoolRequest{Pool: pool}); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		if _, err := asker.RequestAddress(ctx, AddressRequest{PoolID: r.PoolID}); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	reportLatency(b, lat)
}

// discardStore keeps nothing: the heap benchmark measures the allocator.
type discardStore struct{}

func (discardStore) LoadIPAM() (map[string][]byte, error) { return map[string][]byte{}, nil }
func (discardStore) WriteIPAM(map[string][]byte) error    { return nil }

// BenchmarkHeapPer10kAddresses: the Go heap an allocator holds for 10,000
// allocations (with MACs) of one pool.
func BenchmarkHeapPer10kAddresses(b *testing.B) {
	var perTenK uint64
	for b.Loop() {
		a := single(b, discardStore{})
		ctx := context.Background()
		r, err := a.RequestPool(ctx, PoolRequest{Pool: "127.32.0.0/16"})
		if err != nil {
			b.Fatal(err)
		}
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		for i := range 10000 {
			if _, err := a.RequestAddress(ctx, AddressRequest{PoolID: r.PoolID, Options: map[string]string{OptionMACAddress: mac(i>>8, i&0xff)}}); err != nil {
				b.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		perTenK = after.HeapAlloc - before.HeapAlloc
		runtime.KeepAlive(a)
		a.Close()
	}
	b.ReportMetric(float64(perTenK), "heap-B/10k-addrs")
}
